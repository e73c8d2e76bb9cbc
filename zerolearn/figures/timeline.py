"""Figures of recorded step timelines (:mod:`zerolearn.timeline`): who computes, who
communicates and who waits, per rank, at each stage; a bucket-size sweep; ZeRO-3's
prefetch on and off (paper Sec 5.2 buckets, Sec 5.3 prefetch).

Every function takes the stored JSON (dicts, as ``python -m zerolearn.timeline``
writes them), so a chapter draws stored results the same way every time. Times are
stored in seconds and drawn in milliseconds.

Each rank gets three lanes, top to bottom: *compute* (the main thread in forward,
backward or the optimizer step, with the time it spent launching or waiting for
collectives cut out), *comm* (each collective from launch to completion, coloured
and labelled by op; gloo runs it on a thread of its own, so it can run under the
compute above it) and *wait* (the main thread blocked on a collective, hatched; in
grey the end of a wait after the collective had finished, while gloo's thread still
held its tensors; solid, the main thread inside the call that launches an
asynchronous collective).
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from zerolearn.figures.formulas import STAGE_COLORS
from zerolearn.memory.model import STAGE_NAMES
from zerolearn.timeline.intervals import subtract

OP_COLORS = {"all_reduce": "tab:red", "reduce_scatter": "tab:orange", "all_gather": "tab:blue",
             "broadcast": "tab:gray"}
OP_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC"}
COMPUTE_COLORS = {"forward": "#9ecae1", "backward": "#fdd0a2", "step": "#a1d99b"}
__all__ = ["COMPUTE_COLORS", "OP_COLORS", "OP_SHORT", "bucket_sweep_figure", "draw_lanes", "lanes_figure",
           "prefetch_figure", "stage_timelines_figure", "sweep_timelines_figure"]

_MS = 1e3
_RELEASE_COLOR = "0.55"


def _ranks(intervals: list[dict]) -> list[int]:
    return sorted({i["rank"] for i in intervals})


def draw_lanes(ax, intervals: list[dict], ranks: list[int] | None = None, phase: str | None = None) -> float:
    """Draw compute / comm / wait lanes for each of ``ranks`` (default: all) on ``ax``.

    ``phase``: only that phase (``"forward"``, ...): its compute, the collectives
    launched in it and its waits, the x axis cut at the phase's last end. Returns the
    time drawn up to (seconds): the end of the last step (or phase).
    """
    ranks = _ranks(intervals) if ranks is None else ranks
    end = 0.0
    yticks, ylabels = [], []
    for n, r in enumerate(ranks):
        mine = [i for i in intervals if i["rank"] == r and (phase is None or i["lane"] == "step"
                                                           or i.get("phase", i["label"]) == phase)]
        base = 3.4 * (len(ranks) - 1 - n)
        busy = [(i["start"], i["end"]) for i in mine if i["lane"] in ("wait", "launch")]
        for i in mine:
            if i["lane"] == "compute":
                spans = subtract([(i["start"], i["end"])], busy)
                ax.broken_barh([(a * _MS, (b - a) * _MS) for a, b in spans], (base + 2.1, 0.8),
                               color=COMPUTE_COLORS.get(i["label"], "0.8"))
                end = max(end, i["end"])
            elif i["lane"] == "comm":
                ax.broken_barh([(i["start"] * _MS, (i["end"] - i["start"]) * _MS)], (base + 1.1, 0.8),
                               facecolor=OP_COLORS.get(i["label"], "0.5"), edgecolor="white", linewidth=0.4,
                               alpha=0.85)
            elif i["lane"] == "wait":
                ax.broken_barh([(i["start"] * _MS, (i["end"] - i["start"]) * _MS)], (base + 0.1, 0.8),
                               facecolor="white", edgecolor=OP_COLORS.get(i["label"], "0.3"), hatch="////",
                               linewidth=0.6)
                if i.get("release"):  # its end: the collective had finished, gloo still held the tensors
                    ax.broken_barh([((i["end"] - i["release"]) * _MS, i["release"] * _MS)], (base + 0.1, 0.8),
                                   color=_RELEASE_COLOR, linewidth=0)
            elif i["lane"] == "launch":  # the main thread inside an asynchronous call
                ax.broken_barh([(i["start"] * _MS, (i["end"] - i["start"]) * _MS)], (base + 0.1, 0.8),
                               color=OP_COLORS.get(i["label"], "0.3"), linewidth=0)
            elif i["lane"] == "step" and phase is None:
                end = max(end, i["end"])
        yticks += [base + 2.5, base + 1.5, base + 0.5]
        ylabels += [f"rank {r} compute", f"rank {r} comm", f"rank {r} wait"]
    # Names on collectives wide enough to hold one, and not on one that overlaps a named one in time
    # (asynchronous collectives share the lane: their names would print over each other).
    named: dict[int, list[tuple[float, float]]] = {}
    for i in intervals:
        if i["lane"] == "comm" and i["rank"] in ranks and (phase is None or i.get("phase") == phase):
            width = i["end"] - i["start"]
            taken = named.setdefault(i["rank"], [])
            if end and width > 0.06 * end and not any(a < i["end"] and i["start"] < b for a, b in taken):
                taken.append((i["start"], i["end"]))
                base = 3.4 * (len(ranks) - 1 - ranks.index(i["rank"]))
                ax.text((i["start"] + width / 2) * _MS, base + 1.5, OP_SHORT.get(i["label"], i["label"]),
                        ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(yticks, ylabels, fontsize=7)
    ax.set_xlim(0, end * _MS * 1.01 if end else None)
    ax.set_xlabel("time from the step's start (ms)")
    ax.grid(axis="x", alpha=0.3)
    return end


def _legend(fig: Figure, ops: set[str], phases: set[str]) -> None:
    handles = [Patch(color=COMPUTE_COLORS[p], label=f"compute: {p}") for p in COMPUTE_COLORS if p in phases]
    handles += [Patch(color=OP_COLORS[o], label=f"{o} ({OP_SHORT[o]})") for o in OP_COLORS if o in ops]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch="////", label="wait (main thread blocked)"),
                Patch(color=_RELEASE_COLOR, label="wait: done, gloo still holds the tensors"),
                Patch(color="0.3", label="launching an async collective (solid, op colour)")]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize=8)


def lanes_figure(panels: list[tuple[str, list[dict]]], ranks: list[int] | None = None, phase: str | None = None,
                 sharex: bool = True) -> Figure:
    """One panel of lanes (:func:`draw_lanes`) per ``(title, intervals)``, stacked."""
    n_ranks = max(len(ranks or _ranks(iv)) for _, iv in panels)
    fig = Figure(figsize=(9, 0.7 + (0.75 * n_ranks + 0.55) * len(panels) + 0.5), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=sharex, squeeze=False)[:, 0]
    ends = []
    for ax, (title, intervals) in zip(axes, panels, strict=True):
        ends.append(draw_lanes(ax, intervals, ranks, phase))
        ax.set_title(title, fontsize=9, loc="left")
    if sharex:
        for ax in axes[:-1]:
            ax.set_xlabel("")
        axes[-1].set_xlim(0, max(ends) * _MS * 1.01)
    everything = [i for _, iv in panels for i in iv if phase is None or i.get("phase", i["label"]) == phase]
    _legend(fig, {i["label"] for i in everything if i["lane"] == "comm"},
            {i["label"] for i in everything if i["lane"] == "compute"})
    return fig


def _overlap_text(summary: list[dict], phase: str | None = None) -> str:
    rows = [s if phase is None else s["phases"][phase] for s in summary]
    return ", ".join(f"rank {s['rank']}: {r['overlap']:.0%} hidden, wait {r['wait_s'] * _MS:.1f} ms"
                     for s, r in zip(summary, rows, strict=True))


def stage_timelines_figure(stored: dict, stages: tuple[int, ...] = (0, 1, 2, 3),
                           ranks: list[int] | None = None) -> Figure:
    """One recorded step per stage (``stages.json``): lanes per rank, one panel per stage,
    a shared time axis (ms). Titles give each rank's overlap and wait."""
    panels = [(f"Stage {st['stage']} ({STAGE_NAMES[st['stage']]}), {st['buckets']} buckets: "
               + _overlap_text(st["summary"]), st["intervals"]) for st in stored["stages"] if st["stage"] in stages]
    fig = lanes_figure(panels, ranks)
    fig.suptitle(f"One training step on {stored['world_size']} gloo ranks", fontsize=10)
    return fig


def sweep_timelines_figure(stored: dict, ranks: list[int] | None = None) -> Figure:
    """The sweep's stored steps (``bucket_sweep.json`` rows with intervals), one panel per bucket size."""
    panels = [(f"{row['bucket_mb']:g} MiB buckets: {row['buckets']} buckets, "
               f"{sum(row['calls'].values())} collectives", row["intervals"])
              for row in stored["rows"] if "intervals" in row]
    fig = lanes_figure(panels, ranks, sharex=False)
    fig.suptitle(f"Stage {stored['config']['stage']}, one step per bucket size", fontsize=10)
    return fig


def bucket_sweep_figure(stored: dict) -> Figure:
    """Step time, collectives per step and the backward reductions' overlap against
    bucket size (``bucket_sweep.json``; MiB on a log axis, times in ms)."""
    rows = stored["rows"]
    x = [r["bucket_mb"] for r in rows]
    color = STAGE_COLORS.get(stored["config"]["stage"], "tab:blue")
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    left, mid, right = fig.subplots(1, 3)
    left.plot(x, [r["step_s"] * _MS for r in rows], marker="o", color=color, label="step (slowest rank)")
    left.plot(x, [r["wait_s"] * _MS for r in rows], marker="s", color="0.4", label="blocked in waits (mean)")
    left.set_ylabel("time per step (ms)")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    mid.plot(x, [sum(r["calls"].values()) for r in rows], marker="o", color=color, label="collectives")
    mid.plot(x, [r["buckets"] for r in rows], marker="s", color="0.4", label="gradient buckets")
    mid.set_ylabel("per step (count)")
    mid.set_ylim(bottom=0)
    mid.legend(fontsize=8)
    right.plot(x, [r["backward_overlap"] for r in rows], marker="o", color=color)
    right.set_ylabel("reduction time hidden behind backward")
    right.set_ylim(0, 1)
    right.yaxis.set_major_formatter("{x:.0%}")
    for ax in (left, mid, right):
        ax.set_xscale("log")
        ax.set_xlabel("bucket size (MiB)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Bucket size at stage {stored['config']['stage']} on {stored['world_size']} ranks "
                 "(medians over the recorded steps)", fontsize=10)
    return fig


def prefetch_figure(stored: dict, ranks: list[int] | None = None) -> Figure:
    """ZeRO-3's forward with prefetch on and off (``prefetch.json``): the forward phase's
    lanes per rank, each title with the all_gathers' overlap with forward compute."""
    panels = []
    for run in stored["runs"]:
        panels.append((f"prefetch {'on' if run['prefetch'] else 'off'}: all_gather "
                       f"{run['forward_overlap']:.0%} hidden behind forward compute, forward wait "
                       f"{run['forward_wait_s'] * _MS:.1f} ms (mean over ranks)", run["intervals"]))
    fig = lanes_figure(panels, ranks, phase="forward")
    fig.suptitle(f"ZeRO-3 forward (Sec 5.3) on {stored['world_size']} ranks", fontsize=10)
    return fig
