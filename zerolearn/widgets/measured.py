"""Explorers over measured data: a run's memory timeline (``--memory-timeline``) and
fragmentation in the allocator simulator, with and without MD (Sec 6.3)."""

from __future__ import annotations

import ipywidgets as w

from zerolearn import figures
from zerolearn.residual import defrag
from zerolearn.tables import kib
from zerolearn.widgets.base import (
    MIB,
    STAGES,
    STYLE,
    WIDE,
    Explorer,
    html_table,
)

__all__ = ["FragmentationSimulator", "TimelineViewer"]


class TimelineViewer(Explorer):
    """One measured step of ``--memory-timeline`` reports, one stage at a time.

    Args: ``reports``, training reports (docs/ARCHITECTURE.md, "The training run") with a timeline; their
    stages fill the stage menu. ``result``: ``stage``, ``peak_bytes`` and
    ``peak_by_category`` (the ledger's, from the report), ``params_min`` and
    ``params_max`` (bytes of parameters over the step), ``events``.
    """

    def __init__(self, reports: list[dict], rank: int = 0):
        self.reports = {r["config"]["stage"]: r for r in reports}
        self.rank = rank
        cats = list(figures.COLORS)
        super().__init__({
            "stage": w.Dropdown(options=[o for o in STAGES if o[1] in self.reports], value=min(self.reports),
                                description="stage", style=STYLE),
            "categories": w.SelectMultiple(options=cats, value=tuple(cats), rows=5, description="categories",
                                           style=STYLE)})

    def compute(self) -> dict:
        report = self.reports[self.value("stage")]
        series = figures.timeline_series(report, self.rank)
        memory = report["ranks"][self.rank]["memory"]
        params = series["by_category"]["params"]
        return {"stage": self.value("stage"), "peak_bytes": memory["peak_bytes"],
                "peak_by_category": memory["peak_by_category"], "params_min": min(params),
                "params_max": max(params), "events": len(series["index"])}

    def describe(self, r: dict) -> str:
        rows = [[figures.readable(c), kib(b, unit=True)] for c, b in r["peak_by_category"].items()]
        return (f"<p>Stage {r['stage']}: peak <b>{kib(r['peak_bytes'], unit=True)}</b> over {r['events']} events; "
                f"parameters between {kib(r['params_min'])} and {kib(r['params_max'], unit=True)}.</p>"
                + html_table(["at the peak", "bytes"], rows))

    def figure(self):
        return figures.timeline_figure(self.reports[self.value("stage")], tuple(self.value("categories")), self.rank)


PROGRESS = ("Recording the allocations of two training steps of a 25.7M-parameter GPT, then replaying them to "
            "find the smallest arenas: once per kernel, up to a minute on two CPU cores ...")
"""The line :class:`FragmentationSimulator` prints before its first trace is recorded in a process."""


class FragmentationSimulator(Explorer):
    """Replay a trace through a simulated caching allocator, with and without MD (Sec 6.3).

    Args: ``trace`` (default :func:`zerolearn.figures.recorded_trace`). Controls: the
    arena's ``capacity`` in MiB, ``md`` on or off, and ``scale`` (shrinks the
    allocator's size classes, ``defrag.CachingArena``). ``result``: see
    :func:`zerolearn.figures.fragmentation`.
    """

    def __init__(self, trace: list[tuple] | None = None):
        if trace is None and not figures.measured.trace_is_recorded():
            # The first call in a process trains two steps and replays them some 50 times: say so
            # at once, on the cell's output, rather than leave the reader with a silent minute.
            print(PROGRESS, flush=True)
        self.trace = trace or figures.recorded_trace()
        smallest = figures.fragmentation(self.trace, 2**40, True)
        low = max(1, int(smallest["peak_live"] // MIB))
        high = max(low + 1, -(-2 * smallest["smallest_without_md"] // MIB))
        super().__init__({
            "capacity": w.IntSlider(value=-(-smallest["smallest_with_md"] // MIB), min=low, max=high,
                                    description="arena (MiB)", style=STYLE, layout=WIDE),
            "md": w.Checkbox(value=False, description="MD: pool long-lived tensors", style=STYLE, layout=WIDE),
            "scale": w.SelectionSlider(options=[0.5, 1.0, 2.0, 4.0, 8.0], value=1.0, description="size-class scale",
                                       style=STYLE, layout=WIDE)})

    def compute(self) -> dict:
        return figures.fragmentation(self.trace, self.value("capacity") * MIB, self.value("md"), self.value("scale"))

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
        return figures.fragmentation_figure(self.trace, self.value("capacity") * MIB, self.value("md"),
                                            self.value("scale"))
