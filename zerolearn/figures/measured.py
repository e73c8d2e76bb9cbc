"""The figures of measured runs: one step's memory timeline from the ledger
(``--memory-timeline``) and fragmentation in the allocator simulator of
:mod:`zerolearn.residual.defrag` (Sec 6.3). Units: bytes in data, binary KiB / MiB on
the axes, as small models are measured.
"""

from __future__ import annotations

import functools

from matplotlib.figure import Figure

from zerolearn.figures.formulas import COLORS, PHASE_COLORS, readable
from zerolearn.residual import defrag

__all__ = ["fragmentation", "fragmentation_figure", "recorded_trace", "timeline_figure", "timeline_series",
           "trace_is_recorded"]


# ----- (4) the measured timeline ------------------------------------------------------
def timeline_series(report: dict, rank: int = 0) -> dict:
    """One step of a ``--memory-timeline`` report as plottable series (bytes per event).

    Starts at the last event of ``setup`` (the model states registered before the
    step) and returns ``index`` (event numbers from 0), ``phase`` per event,
    ``by_category`` (bytes per category per event), ``total``, and ``spans``: one
    ``(phase, first, last)`` per run of events in the same phase.
    """
    timeline = report["ranks"][rank]["memory"].get("timeline")
    if not timeline:
        raise ValueError("the report has no memory timeline: train with --memory-timeline")
    start = max(0, next((i for i, e in enumerate(timeline) if e[1] != "setup"), len(timeline)) - 1)
    events = timeline[start:]
    phases = [e[1] for e in events]
    spans, first = [], 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[first]:
            spans.append((phases[first], first, i - 1))
            first = i
    cats = list(events[0][3])
    return {"index": list(range(len(events))), "phase": phases, "total": [e[2] for e in events],
            "by_category": {c: [e[3][c] for e in events] for c in cats}, "spans": spans}


def timeline_figure(report: dict, categories: tuple[str, ...] = ("params", "grads", "optimizer_states",
                                                                  "activations", "temporary"),
                    rank: int = 0, title: str | None = None) -> Figure:
    """Bytes per category over one measured step, forward/backward/step shaded."""
    series = timeline_series(report, rank)
    fig = Figure(figsize=(8, 3.8), layout="constrained")
    ax = fig.add_subplot()
    for phase, a, b in series["spans"]:
        if phase in PHASE_COLORS:
            ax.axvspan(a - 0.5, b + 0.5, color=PHASE_COLORS[phase], zorder=0)
            ax.text((a + b) / 2, 1.0, phase, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                    fontsize=8)
    for c in categories:
        ax.step(series["index"], [v / 2**10 for v in series["by_category"][c]], where="post",
                color=COLORS.get(c), label=readable(c))
    ax.set_xlabel("ledger event (an allocation, free or resize), in order")
    ax.set_ylabel("live bytes (KiB)")
    cfg = report["config"]
    ax.set_title(title or f"Measured memory of rank {rank} over one step: stage {cfg['stage']}, "
                          f"{report['world_size']} ranks", pad=14)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot, not over the data
    ax.grid(alpha=0.3)
    return fig


# ----- (5) fragmentation (Sec 6.3) -------------------------------------------------------
_PHASE_COLORS = {"setup": "tab:gray", "forward": "tab:blue", "backward": "tab:red", "step": "tab:green"}


@functools.lru_cache(maxsize=1)
def _recorded() -> tuple:
    return tuple(defrag.record_gpt_steps())


def trace_is_recorded() -> bool:
    """Whether :func:`recorded_trace` has already recorded its trace in this process (so returns at once)."""
    return _recorded.cache_info().currsize > 0


def recorded_trace() -> list[tuple]:
    """The allocation trace of two real training steps, ``defrag.record_gpt_steps()``.

    Recorded once per process (about 10 s on two CPU cores) and reused by the
    fragmentation views and the explorer. Entries are ``(event, uid, bytes, phase)``.
    """
    return list(_recorded())


@functools.lru_cache(maxsize=64)
def _smallest(trace: tuple, md: bool, scale: float) -> int:
    return defrag.smallest_capacity(list(trace), md=md, scale=scale)


def fragmentation(trace: list[tuple], capacity: int, md: bool = False, scale: float = 1.0) -> dict:
    """Replay ``trace`` in an arena of ``capacity`` bytes (``defrag.replay``) and summarise.

    Returns ``ok``, ``failed_event``, ``request`` (the bytes that could not be placed),
    ``free_bytes`` and ``free_fraction`` at the failure (0 when none failed),
    ``headroom`` (capacity minus the live peak), ``reserved`` (bytes the allocator
    holds after each event replayed), ``live`` (bytes live after each event, the
    trace's own count), ``peak_live``, and the smallest arena that works without
    and with MD (``smallest_without_md``, ``smallest_with_md``), all in bytes.
    """
    result = defrag.replay(trace, capacity, md=md, scale=scale)
    live, now = [], 0
    for event, _, nbytes, _ in trace:
        now += nbytes if event == "alloc" else -nbytes
        live.append(now)
    key = tuple(trace)
    return {"ok": result.ok, "reserved": result.reserved, "capacity": capacity, "failed_event": result.failed_event,
            "free_bytes": result.free_bytes_at_failure, "headroom": capacity - max(live),
            "free_fraction": result.free_fraction, "request": result.failed_bytes,
            "live": live, "peak_live": max(live), "smallest_without_md": _smallest(key, False, scale),
            "smallest_with_md": _smallest(key, True, scale)}


def fragmentation_figure(trace: list[tuple] | None = None, capacity: int | None = None, md: bool = False,
                         scale: float = 1.0) -> Figure:
    """Live bytes over the trace, the arena's capacity, and where an allocation fails.

    Defaults: :func:`recorded_trace` in the smallest arena that works *with* MD,
    replayed without it, which fails with over 40% of the arena free. The bytes held
    by long-lived tensors (``defrag.lifetime_classes``, what MD pools) are drawn too.
    """
    trace = trace or recorded_trace()
    capacity = capacity or _smallest(tuple(trace), True, scale)
    r = fragmentation(trace, capacity, md, scale)
    fig = Figure(figsize=(8, 3.8), layout="constrained")
    ax = fig.add_subplot()
    mib, top = 2**20, 1.35 * max(capacity, r["peak_live"]) / 2**20  # a band above the arena line for the legend
    start = 0  # light bands for the phases, named at the bottom
    for i in range(1, len(trace) + 1):
        if i == len(trace) or trace[i][3] != trace[start][3]:
            phase = trace[start][3]
            ax.axvspan(start, i, color=_PHASE_COLORS.get(phase, "white"), alpha=0.12, lw=0)
            if i - start > len(trace) / 25:
                ax.text((start + i) / 2, 0.02 * top, phase, ha="center", va="bottom", fontsize=7, color="0.35")
            start = i
    ax.step(range(len(r["reserved"])), [v / mib for v in r["reserved"]], where="post", color="tab:orange",
            label="reserved by the allocator")
    ax.step(range(len(trace)), [v / mib for v in r["live"]], where="post", label="live tensors")
    long, held, now = defrag.lifetime_classes(trace), [], 0
    for event, uid, nbytes, _ in trace:
        now += (nbytes if event == "alloc" else -nbytes) if uid in long else 0
        held.append(now / mib)
    ax.step(range(len(trace)), held, where="post", color="tab:purple", label="long-lived (pooled by MD)")
    ax.axhline(capacity / mib, color="black", linestyle="--", label=f"arena {capacity / mib:.0f} MiB")
    if not r["ok"]:
        i = r["failed_event"]
        ax.axvline(i, color="tab:red", label=f"out of memory: {r['request'] / mib:.0f} MiB asked, "
                                             f"{r['free_bytes'] / mib:.0f} MiB ({r['free_fraction']:.0%}) free")
    ax.set_xlabel("trace event (allocation or free), in order")
    ax.set_ylabel("bytes (MiB)")
    ax.set_title(f"Fragmentation (Sec 6.3): MD {'on' if md else 'off'}, "
                 f"{'fits' if r['ok'] else 'fails'} in {capacity / mib:.0f} MiB")
    ax.set_xlim(0, len(trace))
    ax.set_ylim(0, top)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    ax.grid(alpha=0.3)
    return fig
