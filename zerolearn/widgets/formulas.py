"""Explorers over the paper's formulas: memory per device by stage (Sec 3, 5, Fig 1),
the smallest fit, and memory against communication (Sec 5, 7)."""

from __future__ import annotations

import ipywidgets as w

from zerolearn import figures
from zerolearn.memory.fit import ActivationSpec, smallest_fit
from zerolearn.memory.model import STAGE_NAMES, optimizer_k
from zerolearn.widgets.base import (
    STAGES,
    STYLE,
    WIDE,
    Explorer,
    dtype_menu,
    gb,
    html_table,
    nd_slider,
    optimizer_menu,
    psi_slider,
)

__all__ = ["FitSolver", "MemoryExplorer", "TradeOff"]


class MemoryExplorer(Explorer):
    """Bytes per device of every stage, by category, against one device's memory (Fig 1).

    ``result``: ``stages`` (``fit.per_device_bytes`` of each stage), ``stage``, ``total``
    (the selected stage's bytes), ``device_bytes``, ``fits``, ``k`` (Sec 3.1).
    """

    def __init__(self, psi: float = 7.5e9, nd: int = 64, stage: int = 3, gpu: str = "V100 32 GB"):
        box = {"style": STYLE}
        super().__init__({
            "psi": psi_slider(psi), "nd": nd_slider(nd),
            "stage": w.Dropdown(options=STAGES, value=stage, description="stage", **box),
            "optimizer": optimizer_menu(), "dtype": dtype_menu(),
            "gpu": w.Dropdown(options=list(figures.GPUS), value=gpu, description="device", **box),
            "activations": w.Checkbox(value=False, description="add activations (Sec 3.2)", layout=WIDE, **box),
            "checkpointing": w.Checkbox(value=False, description="activation checkpointing", layout=WIDE, **box),
            "layers": w.BoundedIntText(value=48, min=1, max=1000, description="layers", **box),
            "hidden": w.BoundedIntText(value=1600, min=1, max=100_000, description="hidden", **box),
            "seq_len": w.BoundedIntText(value=1024, min=1, max=1_000_000, description="sequence length", **box),
            "batch": w.BoundedIntText(value=8, min=1, max=100_000, description="batch per GPU", **box)})

    def activation(self) -> ActivationSpec | None:
        if not self.value("activations"):
            return None
        return ActivationSpec(hidden=self.value("hidden"), layers=self.value("layers"),
                              batch_per_gpu=self.value("batch"), seq_len=self.value("seq_len"),
                              checkpointing=self.value("checkpointing"))

    def compute(self) -> dict:
        stages = figures.memory_by_stage(self.value("psi"), self.value("nd"), optimizer=self.value("optimizer"),
                                         dtype=self.value("dtype"), activation=self.activation())
        stage, device = self.value("stage"), figures.GPUS[self.value("gpu")]
        total = stages[stage]["total"]
        return {"stages": stages, "stage": stage, "total": total, "device_bytes": device, "fits": total <= device,
                "k": optimizer_k(self.value("optimizer"), self.value("dtype"))}

    def describe(self, r: dict) -> str:
        rows = [[f"{s} {STAGE_NAMES[s]}", *(gb(b[c]) for c in figures.CATEGORIES), gb(b["total"])]
                for s, b in r["stages"].items()]
        verdict = "fits" if r["fits"] else "does not fit"
        return (html_table(["stage", *map(figures.readable, figures.CATEGORIES), "total"], rows) +
                f"<p>K = {r['k']} bytes per parameter. Stage {r['stage']} {STAGE_NAMES[r['stage']]} needs "
                f"<b>{gb(r['total'])}</b> per device of {gb(r['device_bytes'])}: <b>{verdict}</b>.</p>")

    def figure(self):
        return figures.memory_figure(self.value("psi"), self.value("nd"), self.value("stage"),
                                     figures.GPUS[self.value("gpu")], optimizer=self.value("optimizer"),
                                     dtype=self.value("dtype"), activation=self.activation())


class FitSolver(Explorer):
    """The fewest GPUs, then the lowest stage, at which a model fits (``fit.smallest_fit``).

    ``result``: ``fit`` (a :class:`~zerolearn.memory.fit.Fit` or None), ``device_bytes``,
    and ``gpus_by_stage`` (the fewest GPUs of each stage, None if over 1024).
    """

    def __init__(self, psi: float = 7e9, gpu: str = "A100 80 GB"):
        super().__init__({"psi": psi_slider(psi),
                          "gpu": w.Dropdown(options=list(figures.GPUS), value=gpu, description="GPU", style=STYLE),
                          "optimizer": optimizer_menu(), "dtype": dtype_menu()})

    def compute(self) -> dict:
        psi, device = self.value("psi"), figures.GPUS[self.value("gpu")]
        kw = {"optimizer": self.value("optimizer"), "dtype": self.value("dtype")}
        return {"fit": smallest_fit(psi, device, **kw), "device_bytes": device,
                "gpus_by_stage": {s: figures.fewest_gpus(psi, device, s, **kw) for s in STAGE_NAMES}}

    def describe(self, r: dict) -> str:
        fit = r["fit"]
        if fit is None:
            answer = "<p><b>No stage fits on 1024 GPUs or fewer.</b></p>"
        else:
            answer = (f"<p>Smallest fit: <b>stage {fit.stage} {fit.stage_name} on {fit.gpus} GPU(s)</b>, "
                      f"{gb(fit.bytes_per_device)} of {gb(fit.device_bytes)} per GPU "
                      f"({100 * fit.utilization:.1f} % used).</p>")
        rows = [[f"{s} {STAGE_NAMES[s]}", "over 1024" if n is None else str(n)] for s, n in r["gpus_by_stage"].items()]
        return answer + html_table(["stage", "fewest GPUs"], rows)

    def figure(self):
        return figures.fit_figure(self.value("psi"), figures.GPUS[self.value("gpu")],
                                  optimizer=self.value("optimizer"), dtype=self.value("dtype"))


class TradeOff(Explorer):
    """Memory per device against communication per step, per stage (Sec 5, Sec 7).

    ``result``: per stage ``bytes`` (model states per device at ``nd``),
    ``traffic_ratio`` (over DP's) and ``traffic_bytes`` (per device per step).
    """

    def __init__(self, psi: float = 7.5e9, nd: int = 64):
        super().__init__({"psi": psi_slider(psi), "nd": nd_slider(nd), "optimizer": optimizer_menu(),
                          "dtype": dtype_menu()})

    def compute(self) -> dict:
        data = figures.tradeoff(self.value("psi"), [self.value("nd")], optimizer=self.value("optimizer"),
                                dtype=self.value("dtype"))
        return {s: {"bytes": d["bytes"][0], "traffic_ratio": d["traffic_ratio"], "traffic_bytes": d["traffic_bytes"]}
                for s, d in data.items()}

    def describe(self, r: dict) -> str:
        rows = [[f"{s} {STAGE_NAMES[s]}", gb(d["bytes"]), f"{d['traffic_ratio']:.2f} x", gb(d["traffic_bytes"])]
                for s, d in r.items()]
        return html_table(["stage", "memory per device", "traffic / DP's", "traffic per step"], rows)

    def figure(self):
        return figures.tradeoff_figure(self.value("psi"), self.value("nd"), optimizer=self.value("optimizer"),
                                       dtype=self.value("dtype"))
