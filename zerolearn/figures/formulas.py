"""The figures of the paper's formulas: memory per stage (Fig 1), the smallest fit,
memory against communication (Sec 3, 5, 7; Table 1), one stage beside DP (chapters 2-4)
and ZeRO-R's residual memory (Sec 6, chapter 5). Pure functions, numbers in and a
matplotlib ``Figure`` out; the numbers are :mod:`zerolearn.memory`'s, nothing is re-derived.

Also the palette and the device list every figure and explorer shares. Units: bytes in
data, the paper's decimal GB (1e9 bytes) on the axes.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from zerolearn.errors import ConfigError, require_choice, require_real
from zerolearn.memory.fit import ActivationSpec, per_device_bytes, smallest_fit
from zerolearn.memory.model import (
    GB,
    STAGE_NAMES,
    activation_bytes,
    comm_volume_elements,
    constant_buffer_bytes,
    dtype_bytes,
    fused_buffer_bytes,
    optimizer_k,
    partitioned_checkpoint_bytes,
    stage_title,
)

__all__ = ["CATEGORIES", "CHECKPOINTS", "COLORS", "GPUS", "NDS", "NMS", "PHASE_COLORS", "RESIDUAL_CATEGORIES",
           "RESIDUAL_NAMES", "STAGE_COLORS", "fewest_gpus", "fit_figure", "memory_by_stage", "memory_figure",
           "readable", "residual_bytes", "residual_figure", "stage_figure", "stage_vs_dp", "tradeoff",
           "tradeoff_figure"]

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
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
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


# ----- (6) a chapter's stage beside DP (chapters 2-4) ---------------------------------
def stage_vs_dp(psi: float, nd: int, stage: int, *, optimizer: str = "adam", dtype: str = "bf16") -> dict:
    """Bytes per device of DP and of ZeRO ``stage`` by category, and the traffic of each per step.

    Model states (``fit.per_device_bytes``; Sec 5.1-5.3, Fig 1), with K bytes of
    optimizer state per parameter (Sec 3.1) and 2-byte working values: DP holds
    (2 + 2 + K) Psi, P_os 2 Psi + 2 Psi + K Psi / Nd, P_os+g 2 Psi + (2 + K) Psi / Nd,
    P_os+g+p (2 + 2 + K) Psi / Nd (4-byte values in fp32). Communication per device
    and step (``model.comm_volume_elements``, Sec 7): 2 Psi elements for DP, P_os and
    P_os+g, 3 Psi for P_os+g+p; its bytes are the elements times the working width.

    Args: psi parameters (> 0); nd (int >= 1); stage 1, 2 or 3; optimizer "adam",
    "adamw" or "sgd"; dtype "bf16", "fp16" or "fp32".
    Returns ``{"stage", "k", "width", "rows": {0: row, stage: row}}``, each row
    ``{"params", "grads", "optimizer_states", "total"}`` in bytes plus
    ``"comm_elements"`` (elements) and ``"comm_bytes"`` (bytes).
    Raises ConfigError (a ValueError) naming a bad value.
    """
    require_choice("stage", stage, (1, 2, 3))
    rows = {}
    for s in (0, stage):
        states = per_device_bytes(psi, nd, s, optimizer=optimizer, dtype=dtype)
        volume = comm_volume_elements(psi, s)
        rows[s] = {**{c: states[c] for c in CATEGORIES[:3]}, "total": states["total"], "comm_elements": volume,
                   "comm_bytes": volume * dtype_bytes(dtype)}
    return {"stage": stage, "k": optimizer_k(optimizer, dtype), "width": dtype_bytes(dtype), "rows": rows}


def _stacked(ax, x: list, rows: list[dict], categories, colors: dict, names: dict | None = None) -> list[float]:
    """Stacked bars of ``rows`` (bytes by category) at ``x``, in GB; returns the bar heights."""
    bottom = [0.0] * len(x)
    for c in categories:
        heights = [r[c] / GB for r in rows]
        if any(heights):
            ax.bar(x, heights, bottom=bottom, color=colors[c], label=(names or {}).get(c, readable(c)),
                   hatch="//" if c == "fragmentation" else None)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for xi, top in zip(x, bottom, strict=True):
        ax.annotate(f"{top:,.2f} GB", (xi, top), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})
    return bottom


def stage_figure(psi: float = 7.5e9, nd: int = 64, stage: int = 1, *, optimizer: str = "adam",
                 dtype: str = "bf16") -> Figure:
    """Left: bytes per device of DP and ``stage``, by category. Right: elements each moves per step.

    The default is Fig 1's setting (Psi = 7.5B, Nd = 64, K = 12) for ZeRO-1: 120 GB
    against 31.4 GB per device, both moving 2 Psi per step (:func:`stage_vs_dp`).
    """
    data = stage_vs_dp(psi, nd, stage, optimizer=optimizer, dtype=dtype)
    rows, names = [data["rows"][0], data["rows"][stage]], ["DP", stage_title(stage)]
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    tops = _stacked(left, [0, 1], rows, CATEGORIES[:3], COLORS)
    left.set_ylim(0, 1.15 * max(tops))
    left.set_xticks([0, 1], names)
    left.set_xlabel("data parallelism and the ZeRO stage")
    left.legend(fontsize=8)
    _gb_axis(left, f"Per device, Psi = {psi / 1e9:g}B, Nd = {nd}, K = {data['k']}")
    multiples = [r["comm_elements"] / psi for r in rows]
    right.bar([0, 1], multiples, color=[STAGE_COLORS[0], STAGE_COLORS[stage]])
    for xi, (m, r) in enumerate(zip(multiples, rows, strict=True)):
        right.annotate(f"{m:g} Psi\n{r['comm_bytes'] / GB:,.1f} GB", (xi, m), xytext=(0, 2),
                       textcoords="offset points", ha="center", va="bottom", fontsize=8)
    right.set_ylim(0, 4)
    right.set_xticks([0, 1], names)
    right.set_xlabel(f"{dtype} elements, the paper's count")
    right.set_ylabel("moved per device per step (x Psi)")
    right.set_title("Communication per step (Sec 7)")
    right.grid(axis="y", alpha=0.3)
    return fig


# ----- (7) ZeRO-R's residual memory (chapter 5) ----------------------------------------
NMS = [2**i for i in range(7)]  # 1 to 64 model-parallel GPUs; the paper uses up to 16 (one DGX-2)
CHECKPOINTS = {"mp": "replicated (MP alone)", "pa": "P_a: partitioned over Nm", "pa_cpu": "P_a+cpu: on the CPU"}
"""Where activation checkpoints live (Sec 6.1): each of the Nm GPUs of a block keeps the
whole checkpoint, 1/Nm of it (P_a), or nothing, its 1/Nm waiting in host memory (P_a+cpu)."""
RESIDUAL_CATEGORIES = ("params", "grads", "optimizer_states", "checkpoints", "buffer", "fragmentation")
_RESIDUAL_COLORS = {**COLORS, "checkpoints": COLORS["activations"], "buffer": COLORS["temporary"],
                    "fragmentation": "tab:brown"}
RESIDUAL_NAMES = {"checkpoints": "activation checkpoints", "buffer": "fused gradient buffer",
                  "fragmentation": "lost to fragmentation"}
"""How people read the categories of :data:`RESIDUAL_CATEGORIES` that are not model states."""


def residual_bytes(psi: float = 1e11, nd: int = 64, stage: int = 2, nm: int = 16, *, hidden: int = 8192,
                   layers: int = 125, seq_len: int = 1024, batch: int = 16, checkpoints: str = "mp",
                   cb_bytes: int | None = None, md: bool = False, fragmentation: float = 0.3,
                   device_bytes: float = 32 * GB, optimizer: str = "adam", dtype: str = "bf16") -> dict:
    """Bytes per device of model states and the residual states ZeRO-R acts on (Sec 3.2, Sec 6).

    * Model states: ``fit.per_device_bytes`` of ``stage`` with Psi / Nm parameters per
      GPU (Sec 5, Table 2).
    * ``checkpoints``: one checkpoint of batch x seq_len x hidden values per block
      (``model.activation_bytes(checkpointing=True)``, Sec 3.2), the same on each of the
      Nm GPUs under MP ("mp"); P_a divides it by Nm (``model.partitioned_checkpoint_bytes``,
      Sec 6.1: about 33 GB becomes about 2 GB for the defaults, a 100B-parameter model
      of 125 x 8192 at batch 16 and Nm = 16: the paper's setting is batch 32, and its
      33 GB is what the formula gives at 16); P_a+cpu keeps none on the device and that
      1/Nm in host memory (Sec 6.1).
    * ``buffer``: the fp32 buffer that fuses every gradient of the GPU's Psi / Nm
      parameters, 4 Psi / Nm bytes (``model.fused_buffer_bytes``, Sec 3.2); with CB it
      is capped at ``cb_bytes`` (``model.constant_buffer_bytes``, Sec 6.2).
    * ``fragmentation``: a simple model, not the paper's (it gives no formula). Without
      MD, the share ``fragmentation`` of the device's memory is lost between long-lived
      tensors; the default 0.3 is the book's reading of Sec 3.2's observation (out of
      memory with over 30% of memory still available), which the paper reports, not a
      share it models (chapter 5's allocator simulator finds over 40% on a real trace).
      With MD (contiguous pools for checkpoints and gradients, Sec 6.3) none is lost.

    Activations other than the checkpoints (the recomputed block's working set) are
    not counted. Args: psi parameters (> 0); nd, nm, hidden, layers, seq_len, batch
    ints >= 1; stage 0-3; ``checkpoints`` a key of :data:`CHECKPOINTS`; ``cb_bytes``
    bytes (> 0) or None for no CB; fragmentation in [0, 1); device_bytes > 0. The
    defaults apply none of ZeRO-R: ``checkpoints``, ``cb_bytes`` and ``md`` turn each on.
    Returns bytes: ``params``, ``grads``, ``optimizer_states``, ``checkpoints`` (on the
    device), ``buffer``, ``fragmentation``, ``total`` (their sum), and
    ``checkpoints_host``, ``checkpoints_replicated`` (what MP alone keeps per GPU),
    ``device_bytes``; ``fits`` (total <= device_bytes).
    Raises ConfigError (a ValueError) naming a bad value.
    """
    states = per_device_bytes(psi, nd, stage, optimizer=optimizer, dtype=dtype, nm=nm)
    require_choice("checkpoints", checkpoints, CHECKPOINTS)
    require_real("fragmentation", fragmentation, strict=False)
    if fragmentation >= 1:
        raise ConfigError(f"fragmentation {fragmentation}: must be a fraction >= 0 and < 1")
    require_real("device_bytes", device_bytes)
    if cb_bytes is not None:
        require_real("cb_bytes", cb_bytes)
    width = dtype_bytes(dtype)
    replicated = activation_bytes(hidden, batch, seq_len, layers, bytes_per_value=width, checkpointing=True)
    partitioned = partitioned_checkpoint_bytes(hidden, batch, seq_len, layers, nm, bytes_per_value=width)
    on_device = {"mp": replicated, "pa": partitioned, "pa_cpu": 0}[checkpoints]
    fused = fused_buffer_bytes(psi / nm)  # fp32, 4 bytes a value (Sec 3.2)
    out = {**{c: states[c] for c in CATEGORIES[:3]}, "checkpoints": on_device,
           "buffer": fused if cb_bytes is None else constant_buffer_bytes(psi / nm, cb_bytes),
           "fragmentation": 0 if md else fragmentation * device_bytes}
    out["total"] = sum(out[c] for c in RESIDUAL_CATEGORIES)
    return {**out, "checkpoints_host": partitioned if checkpoints == "pa_cpu" else 0,
            "checkpoints_replicated": replicated, "device_bytes": device_bytes, "fits": out["total"] <= device_bytes}


def residual_figure(psi: float = 1e11, nd: int = 64, stage: int = 2, nm: int = 16, *, checkpoints: str = "pa",
                    cb_bytes: int | None = 500 * 10**6, md: bool = True, **kw) -> Figure:
    """Left: checkpoint bytes per GPU against Nm, replicated, P_a and P_a+cpu. Right: the
    bytes per GPU without ZeRO-R and with the chosen ZeRO-R, by category, the device as a line.

    The default is Sec 6.1's 100B example (125 x 8192, seq 1K, batch 16: the batch at which
    the formula gives the paper's 33 GB; the paper states batch 32) at Nm = 16,
    Nd = 64 under P_os+g, with P_a, CB at 500 MB and MD, on a 32 GB V100.
    Arguments as :func:`residual_bytes`; "without ZeRO-R" is MP's replicated
    checkpoints, the full fused buffer and no MD.
    """
    chosen = residual_bytes(psi, nd, stage, nm, checkpoints=checkpoints, cb_bytes=cb_bytes, md=md, **kw)
    plain = residual_bytes(psi, nd, stage, nm, checkpoints="mp", cb_bytes=None, md=False, **kw)
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[2, 3])
    for key, style in (("mp", "o-"), ("pa", "s-"), ("pa_cpu", "^-")):
        ys = [residual_bytes(psi, nd, stage, n, checkpoints=key, **kw)["checkpoints"] / GB for n in NMS]
        left.plot(NMS, ys, style, markersize=3, label=CHECKPOINTS[key])
    left.axvline(nm, color="gray", linestyle=":")
    left.set_xscale("log", base=2)
    left.set_xticks(NMS, [str(n) for n in NMS])
    left.set_xlabel("model-parallel degree Nm (GPUs)")
    left.legend(fontsize=8)
    _gb_axis(left, "Activation checkpoints per GPU (Sec 6.1)")
    tops = _stacked(right, [0, 1], [plain, chosen], RESIDUAL_CATEGORIES, _RESIDUAL_COLORS, RESIDUAL_NAMES)
    device = chosen["device_bytes"] / GB
    right.axhline(device, color="black", linestyle="--", label=f"device {device:g} GB")
    right.set_ylim(0, 1.15 * max(*tops, device))
    picked = [n for n, on in (("P_a", checkpoints == "pa"), ("P_a+cpu", checkpoints == "pa_cpu"),
                              ("CB", cb_bytes is not None), ("MD", md)) if on]
    right.set_xticks([0, 1], ["without ZeRO-R", "with " + (" + ".join(picked) or "none of it")])
    right.set_xlabel("ZeRO-R (Sec 6)")
    right.legend(fontsize=7, loc="upper right")
    _gb_axis(right, f"Per GPU, Psi = {psi / 1e9:g}B, Nm = {nm}, Nd = {nd}, {STAGE_NAMES[stage]}")
    return fig
