"""The interactive view of each chapter's stage: ZeRO-1, 2 or 3 beside DP (chapters 2-4),
and ZeRO-R's residual memory (chapter 5). The numbers and figures are
:func:`zerolearn.figures.formulas.stage_vs_dp` and :func:`~zerolearn.figures.formulas.residual_bytes`,
the paper's formulas of :mod:`zerolearn.memory.model`; nothing is computed here."""

from __future__ import annotations

import ipywidgets as w

from zerolearn import figures
from zerolearn.errors import require_choice
from zerolearn.figures import formulas
from zerolearn.memory.model import stage_title
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

__all__ = ["ResidualExplorer", "StageExplorer"]

CB_MB = [25, 50, 100, 250, 500, 1000, 2000]  # CB's cap, MB (1e6 bytes)


class StageExplorer(Explorer):
    """One ZeRO stage beside DP: bytes per device by category and traffic per step (Sec 5, 7).

    Args: ``stage`` 1 (P_os, chapter 2), 2 (P_os+g, chapter 3) or 3 (P_os+g+p,
    chapter 4), preselected; ``psi`` parameters, ``nd`` data-parallel GPUs. The
    defaults are Fig 1's setting (Psi = 7.5B, Nd = 64, mixed-precision Adam, K = 12).
    ``result``: :func:`~zerolearn.figures.formulas.stage_vs_dp` (bytes, elements).

    Raises ConfigError (a ValueError) naming the value: a stage other than 1, 2 or 3,
    an Nd not on the slider (1, 2, 4, ..., 1024), a bad Psi.
    """

    def __init__(self, stage: int = 1, psi: float = 7.5e9, nd: int = 64):
        formulas.stage_vs_dp(psi, nd, stage)  # a bad value fails here, named, not in a widget
        require_choice("nd", nd, figures.NDS)
        super().__init__({
            "psi": psi_slider(psi), "nd": nd_slider(nd),
            "stage": w.Dropdown(options=STAGES[1:], value=stage, description="stage", style=STYLE),
            "optimizer": optimizer_menu(), "dtype": dtype_menu()})

    def settings(self) -> dict:
        return {"optimizer": self.value("optimizer"), "dtype": self.value("dtype")}

    def compute(self) -> dict:
        return formulas.stage_vs_dp(self.value("psi"), self.value("nd"), self.value("stage"), **self.settings())

    def describe(self, r: dict) -> str:
        stage, dp, zero = r["stage"], r["rows"][0], r["rows"][r["stage"]]
        psi = self.value("psi")

        def comm(row: dict) -> str:
            return f"{row['comm_elements'] / psi:g} Psi = {gb(row['comm_bytes'])}"

        rows = [[figures.readable(c), gb(dp[c]), gb(zero[c])] for c in figures.CATEGORIES[:3]]
        rows += [["total", gb(dp["total"]), gb(zero["total"])], ["communication per step", comm(dp), comm(zero)]]
        same = "Sec 7.2.1" if stage == 2 else "Sec 1, Sec 7"  # the paper counts a schedule for stage 2 only
        traffic = (f"as much as DP ({same})" if zero["comm_elements"] == dp["comm_elements"]
                   else f"{zero['comm_elements'] / dp['comm_elements']:g} x DP's (Sec 7.2.2)")
        return (html_table(["per device", "DP", stage_title(stage)], rows) +
                f"<p>K = {r['k']} bytes per parameter. {stage_title(stage)} holds <b>{gb(zero['total'])}</b> per "
                f"device against DP's {gb(dp['total'])} ({dp['total'] / zero['total']:,.2f} x less), and moves "
                f"{comm(zero)} per step, {traffic}.</p>")

    def figure(self):
        return formulas.stage_figure(self.value("psi"), self.value("nd"), self.value("stage"), **self.settings())


class ResidualExplorer(Explorer):
    """ZeRO-R (Sec 6): activation checkpoints, the fused buffer and fragmentation per GPU,
    with model states, under model parallelism of degree Nm.

    Controls: ``psi``, ``nd``, ``nm``, ``stage`` (ZeRO-DP), the device, the model's
    ``hidden``, ``layers``, ``seq_len`` and ``batch`` (per GPU); ``checkpoints``
    (replicated, P_a or P_a+cpu, Sec 6.1), ``cb`` and its cap ``cb_mb`` (MB, 1e6
    bytes, Sec 6.2), ``md`` and the ``fragmentation`` (%) lost without it (a simple
    model, see :func:`~zerolearn.figures.formulas.residual_bytes`). Mixed-precision
    Adam (K = 12) with 2-byte values, as in the paper. The defaults are Sec 6.1's
    100B example (seq 1K, Nm = 16) on 32 GB V100s, in the book's shape (125 x 8192;
    the paper's Table 4 holds its configurations) and at the book's choice of P_os+g
    and Nd = 64 (Sec 6.1 names neither), at batch 16 per GPU: the paper states batch 32,
    but its checkpoints of about 33 GB per GPU (about 2 GB with P_a) are what the formula
    gives at batch 16 (67 GB at 32).

    ``result``: ``{"with": ..., "without": ...}``, each ``residual_bytes`` (bytes): the
    chosen ZeRO-R, and none of it (replicated checkpoints, full buffer, no MD).
    Raises ConfigError (a ValueError) naming a bad value: Nd or Nm not on its slider
    (powers of 2 up to 1024 and 64), a stage outside 0-3, a device not in ``figures.GPUS``.
    """

    def __init__(self, psi: float = 1e11, nd: int = 64, nm: int = 16, stage: int = 2, gpu: str = "V100 32 GB"):
        formulas.residual_bytes(psi, nd, stage, nm)  # a bad value fails here, named, not in a widget
        for name, value, allowed in (("nd", nd, figures.NDS), ("nm", nm, formulas.NMS), ("gpu", gpu, figures.GPUS)):
            require_choice(name, value, allowed)
        box = {"style": STYLE}
        super().__init__({
            "psi": psi_slider(psi), "nd": nd_slider(nd),
            "nm": w.SelectionSlider(options=formulas.NMS, value=nm, description="Nm (model parallel)",
                                    layout=WIDE, **box),
            "stage": w.Dropdown(options=STAGES, value=stage, description="ZeRO-DP stage", **box),
            "hidden": w.BoundedIntText(value=8192, min=1, max=100_000, description="hidden", **box),
            "layers": w.BoundedIntText(value=125, min=1, max=1000, description="layers", **box),
            "seq_len": w.BoundedIntText(value=1024, min=1, max=1_000_000, description="sequence length", **box),
            "batch": w.BoundedIntText(value=16, min=1, max=100_000, description="batch per GPU", **box),
            "checkpoints": w.Dropdown(options=[(v, k) for k, v in formulas.CHECKPOINTS.items()], value="pa",
                                      description="checkpoints", layout=WIDE, **box),
            "gpu": w.Dropdown(options=list(figures.GPUS), value=gpu, description="device", **box),
            "cb": w.Checkbox(value=True, description="CB: constant-size fused buffer", layout=WIDE, **box),
            "cb_mb": w.SelectionSlider(options=CB_MB, value=500, description="CB size (MB)", layout=WIDE, **box),
            "md": w.Checkbox(value=True, description="MD: contiguous pools", layout=WIDE, **box),
            "fragmentation": w.IntSlider(value=30, min=0, max=60, description="lost without MD (%)",
                                         layout=WIDE, **box)})

    def settings(self) -> dict:
        """The arguments of ``residual_bytes`` and ``residual_figure`` shared by both bars."""
        names = ("psi", "nd", "stage", "nm", "hidden", "layers", "seq_len", "batch")
        return {**{n: self.value(n) for n in names}, "fragmentation": self.value("fragmentation") / 100,
                "device_bytes": figures.GPUS[self.value("gpu")]}

    def chosen(self) -> dict:
        return {"checkpoints": self.value("checkpoints"), "md": self.value("md"),
                "cb_bytes": self.value("cb_mb") * 10**6 if self.value("cb") else None}

    def compute(self) -> dict:
        return {"with": formulas.residual_bytes(**self.settings(), **self.chosen()),
                "without": formulas.residual_bytes(**self.settings(), checkpoints="mp", cb_bytes=None, md=False)}

    def describe(self, r: dict) -> str:
        new, old = r["with"], r["without"]
        rows = [[formulas.RESIDUAL_NAMES.get(c, figures.readable(c)), gb(old[c]), gb(new[c])]
                for c in formulas.RESIDUAL_CATEGORIES]
        rows.append(["total", gb(old["total"]), gb(new["total"])])
        verdict = {True: "fits", False: "does not fit"}
        nm = self.value("nm")
        return (html_table(["per GPU", "without ZeRO-R", "with the chosen ZeRO-R"], rows) +
                f"<p>Activation checkpoints: <b>{gb(new['checkpoints'])}</b> on each GPU, "
                f"{gb(new['checkpoints_host'])} in host memory (replicated on the Nm = {nm} GPUs: "
                f"{gb(new['checkpoints_replicated'])}; P_a: {gb(new['checkpoints_replicated'] / nm)}). "
                f"Total <b>{gb(new['total'])}</b> of {gb(new['device_bytes'])}: <b>{verdict[new['fits']]}</b> "
                f"(without ZeRO-R {gb(old['total'])}: {verdict[old['fits']]}).</p>"
                f"<p>Fragmentation is a simple model: without MD, {self.value('fragmentation')} % of the device is "
                "lost (Sec 6.3 saw out of memory with over 30 % free); with MD, none.</p>")

    def figure(self):
        s = self.settings()
        return formulas.residual_figure(s.pop("psi"), s.pop("nd"), s.pop("stage"), s.pop("nm"), **self.chosen(),
                                        **s)

