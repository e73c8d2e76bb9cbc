"""The figures of the paper's formulas: memory per stage (Fig 1), the smallest fit, and
memory against communication (Sec 3, 5, 7; Table 1). Pure functions, numbers in and a
matplotlib ``Figure`` out; the numbers are :mod:`zerolearn.memory`'s, nothing is re-derived.

Also the palette and the device list every figure and explorer shares. Units: bytes in
data, the paper's decimal GB (1e9 bytes) on the axes.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from zerolearn.memory.fit import ActivationSpec, per_device_bytes, smallest_fit
from zerolearn.memory.model import GB, STAGE_NAMES, comm_volume_elements, dtype_bytes

__all__ = ["CATEGORIES", "COLORS", "GPUS", "NDS", "PHASE_COLORS", "STAGE_COLORS", "fewest_gpus", "fit_figure",
           "memory_by_stage", "memory_figure", "readable", "tradeoff", "tradeoff_figure"]

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
