"""Interactive explorers (ipywidgets + matplotlib) over the memory model and measured runs.

Five explorers, each a ``VBox`` to ``display``: its ``controls`` (a dict of widgets
by name), a ``summary`` (HTML with the numbers) and a ``view`` (the figure as a PNG
image). Changing any control's ``value`` recomputes ``result`` (the numbers shown,
in bytes) and redraws. The arithmetic and the figures live in :mod:`zerolearn.views`
as pure functions, so tests check them without a browser and the built book shows
each default view as a static figure.

* :class:`MemoryExplorer` - bytes per device of each stage by category (Sec 3, 5, Fig 1)
* :class:`FitSolver` - the fewest GPUs, then the lowest stage, that fit a model
* :class:`TradeOff` - memory per device against communication per step (Sec 5, 7)
* :class:`TimelineViewer` - a measured ``--memory-timeline`` step, per stage
* :class:`FragmentationSimulator` - Sec 6.3's fragmentation and MD in a simulated allocator
"""

from __future__ import annotations

import contextlib
import io

import ipywidgets as w

from zerolearn import views
from zerolearn.memory.fit import ActivationSpec, smallest_fit
from zerolearn.memory.model import GB, STAGE_NAMES, optimizer_k
from zerolearn.residual import defrag

__all__ = ["FitSolver", "FragmentationSimulator", "MemoryExplorer", "TimelineViewer", "TradeOff"]

_STYLE = {"description_width": "150px"}
_WIDE = w.Layout(width="420px")
_STAGES = [(f"{s} {name}", s) for s, name in STAGE_NAMES.items()]
MIB = 2**20


def gb(nbytes: float) -> str:
    """Bytes in the paper's decimal GB, as the summaries print them."""
    return f"{nbytes / GB:,.2f} GB"


def _psi_slider(value: float) -> w.FloatLogSlider:
    # continuous_update=False: the browser's slider snaps its first position to the
    # step grid and, when updating continuously, sends that back (7.5e9 would become
    # 10**9.88 = 7.59e9 as soon as the view is drawn); without it only a move by the
    # reader changes the value.
    return w.FloatLogSlider(value=value, base=10, min=8, max=12, step=0.01, description="Psi (parameters)",
                            readout_format=".3g", continuous_update=False, style=_STYLE, layout=_WIDE)


def _nd_slider(value: int) -> w.SelectionSlider:
    return w.SelectionSlider(options=views.NDS, value=value, description="Nd (data parallel)", style=_STYLE,
                             layout=_WIDE)


def _optimizer() -> w.Dropdown:
    return w.Dropdown(options=["adam", "adamw", "sgd"], value="adam", description="optimizer", style=_STYLE)


def _dtype() -> w.Dropdown:
    return w.Dropdown(options=["bf16", "fp16", "fp32"], value="bf16", description="working dtype", style=_STYLE)


DPI = 100  # the figure's pixels are shown one to one (see _Explorer): sharp text, no rescaling


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th style='padding:0 8px'>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='padding:0 8px;text-align:right'>{c}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


class _Explorer(w.VBox):
    """Controls, a summary and a figure; ``refresh`` runs on every change of a control."""

    def __init__(self, controls: dict[str, w.Widget]):
        self.controls = controls
        # The image at its own size (a box stretches its children to full width by
        # default, which blurs the figure), but never wider than the output.
        self.summary = w.HTML()
        self.view = w.Image(format="png", layout=w.Layout(align_self="flex-start", max_width="100%"))
        self.result: dict = {}
        self._held = False
        grid = w.GridBox(list(controls.values()), layout=w.Layout(grid_template_columns="repeat(2, 440px)"))
        super().__init__([grid, self.summary, self.view])
        for control in controls.values():
            control.observe(lambda _: None if self._held else self.refresh(), names="value")
        self.refresh()

    @contextlib.contextmanager
    def hold(self):
        """Change several controls at once: one refresh at the end, not one per change."""
        self._held = True
        try:
            yield self
        finally:
            self._held = False
            self.refresh()

    def __repr__(self) -> str:  # short and stable: notebooks store it as the widget's text
        return f"{type(self).__name__}({', '.join(f'{k}={c.value!r}' for k, c in self.controls.items())})"

    def value(self, name: str):
        return self.controls[name].value

    def refresh(self) -> None:
        self.result = self.compute()
        # The figure first, the summary last: the browser applies them in order, so a
        # summary on the page is never ahead of the figure under it.
        self.view.value = _png(self.figure())
        self.summary.value = self.describe(self.result)

    def compute(self) -> dict:  # pragma: no cover - every explorer overrides these
        raise NotImplementedError

    def describe(self, result: dict) -> str:  # pragma: no cover
        raise NotImplementedError

    def figure(self):  # pragma: no cover
        raise NotImplementedError


class MemoryExplorer(_Explorer):
    """Bytes per device of every stage, by category, against one device's memory (Fig 1).

    ``result``: ``stages`` (``fit.per_device_bytes`` of each stage), ``stage``, ``total``
    (the selected stage's bytes), ``device_bytes``, ``fits``, ``k`` (Sec 3.1).
    """

    def __init__(self, psi: float = 7.5e9, nd: int = 64, stage: int = 3, gpu: str = "V100 32 GB"):
        box = {"style": _STYLE}
        super().__init__({
            "psi": _psi_slider(psi), "nd": _nd_slider(nd),
            "stage": w.Dropdown(options=_STAGES, value=stage, description="stage", **box),
            "optimizer": _optimizer(), "dtype": _dtype(),
            "gpu": w.Dropdown(options=list(views.GPUS), value=gpu, description="device", **box),
            "activations": w.Checkbox(value=False, description="add activations (Sec 3.2)", layout=_WIDE, **box),
            "checkpointing": w.Checkbox(value=False, description="activation checkpointing", layout=_WIDE, **box),
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
        stages = views.memory_by_stage(self.value("psi"), self.value("nd"), optimizer=self.value("optimizer"),
                                       dtype=self.value("dtype"), activation=self.activation())
        stage, device = self.value("stage"), views.GPUS[self.value("gpu")]
        total = stages[stage]["total"]
        return {"stages": stages, "stage": stage, "total": total, "device_bytes": device, "fits": total <= device,
                "k": optimizer_k(self.value("optimizer"), self.value("dtype"))}

    def describe(self, r: dict) -> str:
        rows = [[f"{s} {STAGE_NAMES[s]}", *(gb(b[c]) for c in views.CATEGORIES), gb(b["total"])]
                for s, b in r["stages"].items()]
        verdict = "fits" if r["fits"] else "does not fit"
        return (_table(["stage", *map(views.readable, views.CATEGORIES), "total"], rows) +
                f"<p>K = {r['k']} bytes per parameter. Stage {r['stage']} {STAGE_NAMES[r['stage']]} needs "
                f"<b>{gb(r['total'])}</b> per device of {gb(r['device_bytes'])}: <b>{verdict}</b>.</p>")

    def figure(self):
        return views.memory_figure(self.value("psi"), self.value("nd"), self.value("stage"),
                                   views.GPUS[self.value("gpu")], optimizer=self.value("optimizer"),
                                   dtype=self.value("dtype"), activation=self.activation())


class FitSolver(_Explorer):
    """The fewest GPUs, then the lowest stage, at which a model fits (``fit.smallest_fit``).

    ``result``: ``fit`` (a :class:`~zerolearn.memory.fit.Fit` or None), ``device_bytes``,
    and ``gpus_by_stage`` (the fewest GPUs of each stage, None if over 1024).
    """

    def __init__(self, psi: float = 7e9, gpu: str = "A100 80 GB"):
        super().__init__({"psi": _psi_slider(psi),
                          "gpu": w.Dropdown(options=list(views.GPUS), value=gpu, description="GPU", style=_STYLE),
                          "optimizer": _optimizer(), "dtype": _dtype()})

    def compute(self) -> dict:
        psi, device = self.value("psi"), views.GPUS[self.value("gpu")]
        kw = {"optimizer": self.value("optimizer"), "dtype": self.value("dtype")}
        return {"fit": smallest_fit(psi, device, **kw), "device_bytes": device,
                "gpus_by_stage": {s: views.fewest_gpus(psi, device, s, **kw) for s in STAGE_NAMES}}

    def describe(self, r: dict) -> str:
        fit = r["fit"]
        if fit is None:
            answer = "<p><b>No stage fits on 1024 GPUs or fewer.</b></p>"
        else:
            answer = (f"<p>Smallest fit: <b>stage {fit.stage} {fit.stage_name} on {fit.gpus} GPU(s)</b>, "
                      f"{gb(fit.bytes_per_device)} of {gb(fit.device_bytes)} per GPU "
                      f"({100 * fit.utilization:.1f} % used).</p>")
        rows = [[f"{s} {STAGE_NAMES[s]}", "over 1024" if n is None else str(n)] for s, n in r["gpus_by_stage"].items()]
        return answer + _table(["stage", "fewest GPUs"], rows)

    def figure(self):
        return views.fit_figure(self.value("psi"), views.GPUS[self.value("gpu")],
                                optimizer=self.value("optimizer"), dtype=self.value("dtype"))


class TradeOff(_Explorer):
    """Memory per device against communication per step, per stage (Sec 5, Sec 7).

    ``result``: per stage ``bytes`` (model states per device at ``nd``),
    ``traffic_ratio`` (over DP's) and ``traffic_bytes`` (per device per step).
    """

    def __init__(self, psi: float = 7.5e9, nd: int = 64):
        super().__init__({"psi": _psi_slider(psi), "nd": _nd_slider(nd), "optimizer": _optimizer(),
                          "dtype": _dtype()})

    def compute(self) -> dict:
        data = views.tradeoff(self.value("psi"), [self.value("nd")], optimizer=self.value("optimizer"),
                              dtype=self.value("dtype"))
        return {s: {"bytes": d["bytes"][0], "traffic_ratio": d["traffic_ratio"], "traffic_bytes": d["traffic_bytes"]}
                for s, d in data.items()}

    def describe(self, r: dict) -> str:
        rows = [[f"{s} {STAGE_NAMES[s]}", gb(d["bytes"]), f"{d['traffic_ratio']:.2f} x", gb(d["traffic_bytes"])]
                for s, d in r.items()]
        return _table(["stage", "memory per device", "traffic / DP's", "traffic per step"], rows)

    def figure(self):
        return views.tradeoff_figure(self.value("psi"), self.value("nd"), optimizer=self.value("optimizer"),
                                     dtype=self.value("dtype"))


class TimelineViewer(_Explorer):
    """One measured step of ``--memory-timeline`` reports, one stage at a time.

    Args: ``reports``, training reports (DESIGN section 4) with a timeline; their
    stages fill the stage menu. ``result``: ``stage``, ``peak_bytes`` and
    ``peak_by_category`` (the ledger's, from the report), ``params_min`` and
    ``params_max`` (bytes of parameters over the step), ``events``.
    """

    def __init__(self, reports: list[dict], rank: int = 0):
        self.reports = {r["config"]["stage"]: r for r in reports}
        self.rank = rank
        cats = list(views.COLORS)
        super().__init__({
            "stage": w.Dropdown(options=[o for o in _STAGES if o[1] in self.reports], value=min(self.reports),
                                description="stage", style=_STYLE),
            "categories": w.SelectMultiple(options=cats, value=tuple(cats), rows=5, description="categories",
                                           style=_STYLE)})

    def compute(self) -> dict:
        report = self.reports[self.value("stage")]
        series = views.timeline_series(report, self.rank)
        memory = report["ranks"][self.rank]["memory"]
        params = series["by_category"]["params"]
        return {"stage": self.value("stage"), "peak_bytes": memory["peak_bytes"],
                "peak_by_category": memory["peak_by_category"], "params_min": min(params),
                "params_max": max(params), "events": len(series["index"])}

    def describe(self, r: dict) -> str:
        rows = [[views.readable(c), f"{b / 2**10:,.1f} KiB"] for c, b in r["peak_by_category"].items()]
        return (f"<p>Stage {r['stage']}: peak <b>{r['peak_bytes'] / 2**10:,.1f} KiB</b> over {r['events']} events; "
                f"parameters between {r['params_min'] / 2**10:,.1f} and {r['params_max'] / 2**10:,.1f} KiB.</p>"
                + _table(["at the peak", "bytes"], rows))

    def figure(self):
        return views.timeline_figure(self.reports[self.value("stage")], tuple(self.value("categories")), self.rank)


class FragmentationSimulator(_Explorer):
    """Replay a trace through a simulated caching allocator, with and without MD (Sec 6.3).

    Args: ``trace`` (default :func:`zerolearn.views.recorded_trace`). Controls: the
    arena's ``capacity`` in MiB, ``md`` on or off, and ``scale`` (shrinks the
    allocator's size classes, ``defrag.CachingArena``). ``result``: see
    :func:`zerolearn.views.fragmentation`.
    """

    def __init__(self, trace: list[tuple] | None = None):
        self.trace = trace or views.recorded_trace()
        smallest = views.fragmentation(self.trace, 2**40, True)
        low = max(1, int(smallest["peak_live"] // MIB))
        high = max(low + 1, -(-2 * smallest["smallest_without_md"] // MIB))
        super().__init__({
            "capacity": w.IntSlider(value=-(-smallest["smallest_with_md"] // MIB), min=low, max=high,
                                    description="arena (MiB)", style=_STYLE, layout=_WIDE),
            "md": w.Checkbox(value=False, description="MD: pool long-lived tensors", style=_STYLE, layout=_WIDE),
            "scale": w.SelectionSlider(options=[0.5, 1.0, 2.0, 4.0, 8.0], value=1.0, description="size-class scale",
                                       style=_STYLE, layout=_WIDE)})

    def compute(self) -> dict:
        return views.fragmentation(self.trace, self.value("capacity") * MIB, self.value("md"), self.value("scale"))

    def describe(self, r: dict) -> str:
        mib = f"{r['capacity'] / MIB:g} MiB"
        if r["ok"]:
            head = f"<p><b>Fits</b> in {mib}: {r['headroom'] / MIB:g} MiB above the live peak.</p>"
        else:
            head = (f"<p><b>Out of memory</b> in {mib} at event {r['failed_event']}: "
                    f"{r['request'] / MIB:g} MiB did not fit while {r['free_bytes'] / MIB:g} MiB "
                    f"({100 * r['free_fraction']:.0f} %) was free, in pieces too small.</p>")
        return head + (f"<p>Live peak {r['peak_live'] / MIB:g} MiB; smallest arena without MD "
                       f"{r['smallest_without_md'] / MIB:g} MiB, with MD {r['smallest_with_md'] / MIB:g} MiB "
                       f"(alignment {defrag.ALIGN} bytes).</p>")

    def figure(self):
        return views.fragmentation_figure(self.trace, self.value("capacity") * MIB, self.value("md"),
                                          self.value("scale"))
