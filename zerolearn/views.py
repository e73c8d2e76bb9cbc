"""What the explorers of :mod:`zerolearn.widgets` compute and draw, without any widget.

Every function here is pure (numbers in, numbers or a matplotlib ``Figure`` out), so
tests call them directly and the built book shows each explorer's default view as a
static figure, no kernel needed. The numbers come from the paper's formulas in
:mod:`zerolearn.memory` (Sec 3, 5, 7; Fig 1; Table 1), from measured training reports
(``--memory-timeline``), or from the allocator simulator of
:mod:`zerolearn.residual.defrag` (Sec 6.3); nothing is re-derived here.

Units: bytes in data. Figures of formulas use the paper's decimal GB (1e9 bytes);
figures of measured runs use binary KiB (2**10 bytes), as small models are measured.
"""

from __future__ import annotations

import functools

from matplotlib.figure import Figure

from zerolearn.memory.fit import ActivationSpec, per_device_bytes, smallest_fit
from zerolearn.memory.model import GB, STAGE_NAMES, comm_volume_elements, dtype_bytes
from zerolearn.residual import defrag

__all__ = ["CATEGORIES", "GPUS", "NDS", "fewest_gpus", "fit_figure", "fragmentation", "fragmentation_figure",
           "memory_by_stage", "memory_figure", "readable", "recorded_trace", "timeline_figure", "timeline_series",
           "tradeoff", "tradeoff_figure"]

GPUS = {"V100 16 GB": 16 * GB, "V100 32 GB": 32 * GB, "RTX 4090 24 GB": 24 * GB, "A100 40 GB": 40 * GB,
        "L40S 48 GB": 48 * GB, "A100 80 GB": 80 * GB, "H100 80 GB": 80 * GB, "H200 141 GB": 141 * GB,
        "B200 192 GB": 192 * GB, "MI300X 192 GB": 192 * GB}
"""Device memory of common GPUs in bytes, at the nominal size in the paper's decimal GB.

A card sold as "80 GB" holds 80 GiB (7% more than 80e9 bytes), but the CUDA context,
the framework and the allocator's cache take some of it; the nominal decimal number
is the paper's convention (a 32 GB V100 is 32e9 bytes in Table 2) and a fair budget."""

NDS = [2**i for i in range(11)]  # 1, 2, 4, ..., 1024: Table 1's range
CATEGORIES = ("params", "grads", "optimizer_states", "activations")
COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer_states": "tab:green",
          "activations": "tab:purple", "temporary": "tab:gray"}
STAGE_COLORS = {0: "tab:red", 1: "tab:orange", 2: "tab:green", 3: "tab:blue"}
PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde2cf", "step": "#dff0d8"}


def _label(stage: int) -> str:
    return f"{stage} {STAGE_NAMES[stage]}"


def readable(category: str) -> str:
    """A category as people read it: ``optimizer_states`` -> ``optimizer states``."""
    return category.replace("_", " ")


# ----- (1) memory explorer and (2) fit solver: the paper's formulas ------------------
def memory_by_stage(psi: float, nd: int, *, optimizer: str = "adam", dtype: str = "bf16",
                    activation: ActivationSpec | None = None) -> dict[int, dict]:
    """Bytes per device of every stage (``fit.per_device_bytes``: Sec 3.1, 3.2, 5, Fig 1)."""
    return {s: per_device_bytes(psi, nd, s, optimizer=optimizer, dtype=dtype, activation=activation)
            for s in STAGE_NAMES}


def fewest_gpus(psi: float, device_bytes: float, stage: int, *, optimizer: str = "adam", dtype: str = "bf16",
                activation: ActivationSpec | None = None, max_nd: int = 1024) -> int | None:
    """Smallest Nd <= ``max_nd`` at which ``stage`` fits ``device_bytes`` per device, or None.

    Bisection is valid because per-device bytes never grow with Nd (Sec 5).
    """
    def fits(nd: int) -> bool:
        need = per_device_bytes(psi, nd, stage, optimizer=optimizer, dtype=dtype, activation=activation)
        return need["total"] <= device_bytes

    if not fits(max_nd):
        return None
    lo, hi = 1, max_nd
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return hi


def _gb_axis(ax, title: str) -> None:
    ax.set_ylabel("memory per device (GB, 1e9 bytes)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def memory_figure(psi: float = 7.5e9, nd: int = 64, stage: int = 3, device_bytes: float = 32 * GB, *,
                  optimizer: str = "adam", dtype: str = "bf16",
                  activation: ActivationSpec | None = None) -> Figure:
    """Stacked bars of each stage's bytes by category, the device's memory as a line.

    The default is Fig 1's setting: Psi = 7.5B, Nd = 64, mixed-precision Adam (K = 12)
    on a 32 GB V100. The selected ``stage`` is outlined in black.
    """
    rows = memory_by_stage(psi, nd, optimizer=optimizer, dtype=dtype, activation=activation)
    fig = Figure(figsize=(7, 3.8), layout="constrained")
    ax = fig.add_subplot()
    x = list(STAGE_NAMES)
    bottom = [0.0] * len(x)
    for c in CATEGORIES:
        heights = [rows[s][c] / GB for s in x]
        if any(heights):
            ax.bar(x, heights, bottom=bottom, color=COLORS[c], label=readable(c))
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar([stage], [bottom[stage]], fill=False, edgecolor="black", linewidth=2, label=f"selected: stage {stage}")
    ax.axhline(device_bytes / GB, color="black", linestyle="--", label=f"device {device_bytes / GB:g} GB")
    for s in x:  # on a white box, so the device line never runs through the number
        ax.annotate(f"{bottom[s]:,.1f} GB", (s, bottom[s]), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})
    ax.set_ylim(0, 1.12 * max(*bottom, device_bytes / GB))  # room for the numbers above the bars
    ax.set_xticks(x, [_label(s) for s in x])
    ax.set_xlabel("ZeRO stage")
    ax.legend(fontsize=8)
    _gb_axis(ax, f"Per-device memory, Psi = {psi / 1e9:g}B, Nd = {nd}, {optimizer} {dtype}")
    return fig


def fit_figure(psi: float = 7e9, device_bytes: float = 80 * GB, *, optimizer: str = "adam",
               dtype: str = "bf16", activation: ActivationSpec | None = None) -> Figure:
    """Per-device bytes against Nd for each stage, the device line and the smallest fit marked."""
    fig = Figure(figsize=(7, 3.8), layout="constrained")
    ax = fig.add_subplot()
    for s in STAGE_NAMES:
        ys = [per_device_bytes(psi, nd, s, optimizer=optimizer, dtype=dtype, activation=activation)["total"] / GB
              for nd in NDS]
        ax.plot(NDS, ys, marker="o", markersize=3, color=STAGE_COLORS[s], label=_label(s))
    ax.axhline(device_bytes / GB, color="black", linestyle="--", label=f"device {device_bytes / GB:g} GB")
    fit = smallest_fit(psi, device_bytes, optimizer=optimizer, dtype=dtype, activation=activation)
    if fit is not None:
        ax.plot([fit.nd], [fit.bytes_per_device / GB], marker="*", markersize=16, color="black",
                linestyle="none", label=f"fit: stage {fit.stage} on {fit.gpus} GPU(s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel degree Nd (GPUs)")
    ax.legend(fontsize=8)
    _gb_axis(ax, f"Can {psi / 1e9:g}B parameters fit on {device_bytes / GB:g} GB devices?")
    return fig


# ----- (3) memory against communication ----------------------------------------------
def tradeoff(psi: float, nds: list[int] = NDS, *, optimizer: str = "adam", dtype: str = "bf16") -> dict[int, dict]:
    """Per stage: model-state bytes per device at each Nd, and traffic per step (Sec 5, 7).

    ``traffic_ratio`` is the stage's volume over DP's (1 for stages 0-2, 1.5 for stage
    3, Sec 7.2); ``traffic_bytes`` is the volume in bytes of the working dtype.
    """
    dp = comm_volume_elements(psi, 0)
    return {s: {"nds": list(nds),
                "bytes": [per_device_bytes(psi, nd, s, optimizer=optimizer, dtype=dtype)["total"] for nd in nds],
                "traffic_ratio": comm_volume_elements(psi, s) / dp,
                "traffic_bytes": comm_volume_elements(psi, s) * dtype_bytes(dtype)}
            for s in STAGE_NAMES}


def tradeoff_figure(psi: float = 7.5e9, nd: int = 64, *, optimizer: str = "adam", dtype: str = "bf16") -> Figure:
    """Left: memory per device against Nd. Right: memory at ``nd`` against traffic per step."""
    data = tradeoff(psi, NDS, optimizer=optimizer, dtype=dtype)
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for s, d in data.items():
        left.plot(d["nds"], [b / GB for b in d["bytes"]], marker="o", markersize=3, color=STAGE_COLORS[s],
                  label=_label(s))
        mem = per_device_bytes(psi, nd, s, optimizer=optimizer, dtype=dtype)["total"] / GB
        right.scatter([d["traffic_ratio"]], [mem], s=80, color=STAGE_COLORS[s], label=_label(s), zorder=3)
        right.annotate(f"  {_label(s)}: {mem:,.1f} GB", (d["traffic_ratio"], mem), fontsize=8, va="center")
    left.axvline(nd, color="gray", linestyle=":")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("data-parallel degree Nd (GPUs)")
    _gb_axis(left, f"Memory per device, Psi = {psi / 1e9:g}B")
    left.legend(fontsize=8)
    right.set_yscale("log")
    right.set_xlim(0.8, 2.1)  # room for the labels right of the points
    right.set_xlabel("communication per step, relative to DP (Sec 7)")
    _gb_axis(right, f"The trade-off at Nd = {nd}")
    return fig


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
