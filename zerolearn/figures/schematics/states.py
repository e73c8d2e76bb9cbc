"""Who holds which slice of the model states, per stage (the paper's Fig 1), and where each
byte lives under offload (chapter 8).

The slices are :class:`zerolearn.flat.FlatLayout`'s: parameters laid end to end in one flat
buffer, padded with zeros to a multiple of Nd, shard r the r-th equal slice (Sec 5). Which
category a stage partitions is read off the paper's formulas
(:func:`zerolearn.memory.model.model_state_bytes`: a category is partitioned at a stage when
its bytes per device fall with Nd), and the bytes drawn are elements held times the bytes
per element of each category: 2 + 2 + K of Sec 3.1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from zerolearn.errors import ConfigError, require_choice, require_count, require_real
from zerolearn.figures.formulas import COLORS, readable
from zerolearn.figures.schematics.palette import PADDING_HATCH, box, rank_color
from zerolearn.flat import FlatLayout
from zerolearn.memory.model import STAGE_NAMES, model_state_bytes, offload_state_bytes, stage_title

__all__ = ["DEFAULT_SHAPES", "MODEL_CATEGORIES", "ModelStates", "Slice", "model_states", "model_states_figure",
           "offload_figure", "offload_placement", "partitioned"]

MODEL_CATEGORIES = ("params", "grads", "optimizer_states")
DEFAULT_SHAPES = {"fc1.weight": (4, 3), "fc1.bias": (4,), "fc2.weight": (2, 4), "fc2.bias": (2,)}
"""A two-layer model of 26 parameters: at Nd = 3 the flat buffer is padded to 27 (one zero)."""


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, end)`` of one category's flat buffer, owned by rank ``owner``.

    ``held``: the rank drawn holds them; ``nbytes``: bytes it holds of them (0 if not held),
    padding included.
    """

    category: str
    start: int
    end: int
    owner: int
    held: bool
    nbytes: int


@dataclass(frozen=True)
class ModelStates:
    """Fig 1's layout on a small flat buffer.

    Attributes:
        nd: data-parallel degree. layouts: the :class:`FlatLayout` of each rank (shard_index r).
        numel: Psi (elements, unpadded); padded_numel, shard_numel: as in the layout.
        bytes_per_element: per category, 2 (params), 2 (grads), K (optimizer states).
        slices: ``slices[stage][rank]``, every category's Nd owner slices, held or not.
        held_bytes: ``held_bytes[stage][rank]``, bytes of model states the rank holds.
        formula_bytes: ``formula_bytes[stage]``, :func:`model_state_bytes` of Psi (no padding).
    """

    nd: int
    layouts: tuple[FlatLayout, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    bytes_per_element: dict[str, float]
    slices: dict[int, list[list[Slice]]]
    held_bytes: dict[int, list[float]]
    formula_bytes: dict[int, dict[str, float]]


def partitioned(stage: int) -> dict[str, bool]:
    """Which model-state category ``stage`` (0-3) partitions over Nd, read off the paper's
    formulas (Sec 5.1-5.3: P_os, P_os+g, P_os+g+p): its bytes per device at Nd = 2 are below Nd = 1."""
    require_choice("stage", stage, tuple(STAGE_NAMES))
    one, two = model_state_bytes(1, 1, stage), model_state_bytes(1, 2, stage)
    return {c: two[c] < one[c] for c in MODEL_CATEGORIES}


def model_states(nd: int = 3, shapes: dict[str, tuple[int, ...]] | None = None, *, k: float = 12,
                 param_bytes: float = 2, grad_bytes: float = 2) -> ModelStates:
    """The slices each of ``nd`` ranks holds at every stage, from :class:`FlatLayout` (Sec 5, Fig 1).

    Args:
        nd: data-parallel degree, integer 1-8 (a drawing of more ranks is unreadable).
        shapes: parameter name -> shape, in buffer order (default :data:`DEFAULT_SHAPES`).
        k: optimizer bytes per parameter (Sec 3.1; mixed-precision Adam 12); param_bytes and
            grad_bytes: bytes per element of the working parameters and gradients (fp16: 2).

    Returns:
        a :class:`ModelStates`; every count in elements, every size in bytes.

    Raises:
        ConfigError: ``nd`` outside 1-8, an empty ``shapes`` or a size <= 0.
    """
    require_count("nd", nd)
    if nd > 8:
        raise ConfigError(f"nd {nd}: allowed are 1 to 8 ranks in a drawing")
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    if not shapes:
        raise ConfigError("shapes {}: allowed is a dict of at least one parameter name -> shape")
    for name, value in (("k", k), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        require_real(name, value, strict=name != "k")
    names, sizes = list(shapes), [torch.Size(s) for s in shapes.values()]
    first = FlatLayout.of(names, sizes, nd, 0)
    layouts = tuple(dataclasses.replace(first, shard_index=r) for r in range(nd))
    per = {"params": param_bytes, "grads": grad_bytes, "optimizer_states": k}
    slices, held_bytes, formula = {}, {}, {}
    for stage in STAGE_NAMES:
        split = partitioned(stage)
        rows = []
        for layout in layouts:
            mine = []
            for c in MODEL_CATEGORIES:
                for owner in range(nd):
                    a, b = layouts[owner].shard_range
                    held = not split[c] or owner == layout.shard_index
                    mine.append(Slice(c, a, b, owner, held, (b - a) * per[c] if held else 0))
            rows.append(mine)
        slices[stage] = rows
        held_bytes[stage] = [sum(s.nbytes for s in row) for row in rows]
        formula[stage] = model_state_bytes(first.numel, nd, stage, k, param_bytes, grad_bytes)
    return ModelStates(nd, layouts, first.numel, first.padded_numel, first.shard_numel, per, slices, held_bytes,
                       formula)


def model_states_figure(nd: int = 3, shapes: dict[str, tuple[int, ...]] | None = None, *, k: float = 12,
                        stages: tuple[int, ...] = (0, 1, 2, 3)) -> Figure:
    """Fig 1 on a small buffer: per stage, per rank, the three flat buffers (params, grads,
    optimizer states) with each slice coloured by its owner; held slices solid, the rest faint;
    the padding hatched; bytes held per rank on the right (:func:`model_states`)."""
    data = model_states(nd, shapes, k=k)
    for s in stages:
        require_choice("stage", s, tuple(STAGE_NAMES))
    fig = Figure(figsize=(8, 1.0 + 0.55 * nd * len(stages)), layout="constrained")
    axes = fig.subplots(len(stages), 1, squeeze=False)[:, 0]
    n = data.padded_numel
    for ax, stage in zip(axes, stages, strict=True):
        y = 0.0
        ticks, labels = [], []
        for rank in reversed(range(nd)):
            for ci, c in enumerate(reversed(MODEL_CATEGORIES)):
                row = [s for s in data.slices[stage][rank] if s.category == c]
                for s in row:
                    pad = max(0, s.end - max(s.start, data.numel))
                    box(ax, s.start, y, s.end - s.start - pad, 0.8, rank_color(s.owner), held=s.held)
                    if pad:
                        box(ax, s.end - pad, y, pad, 0.8, rank_color(s.owner), held=s.held, hatch=PADDING_HATCH)
                ticks.append(y + 0.4)
                labels.append(f"rank {rank} {readable(c)}" if ci == 1 else readable(c))
                y += 1
            ax.text(n * 1.01, y - 1.5, f"{data.held_bytes[stage][rank]:g} B", va="center", fontsize=7)
            y += 0.4
        ax.set_xlim(0, n * 1.12)
        ax.set_ylim(-0.2, y)
        ax.set_yticks(ticks, labels, fontsize=6)
        ax.set_title(f"{stage_title(stage)}: formula {data.formula_bytes[stage]['total']:g} B per rank "
                     f"(Psi = {data.numel}, padded to {data.padded_numel})", fontsize=8, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1].set_xlabel("element of the flat buffer (FlatLayout offset)")
    handles = [Patch(color=rank_color(r), label=f"shard of rank {r}") for r in range(nd)]
    handles.append(Patch(facecolor="white", edgecolor="0.3", hatch=PADDING_HATCH, label="padding (zeros)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=7)
    fig.suptitle(f"Model states held by each of Nd = {nd} ranks (solid: held; faint: another rank's), "
                 f"{data.bytes_per_element['params']:g} + {data.bytes_per_element['grads']:g} + K (K = {k:g}) = "
                 f"{data.bytes_per_element['params'] + data.bytes_per_element['grads'] + k:g} bytes per parameter",
                 fontsize=9)
    return fig


# ----- chapter 8: where each byte lives under offload ------------------------------------------
LOCATIONS = ("device", "host", "disk")


def offload_placement(psi: float = 7.5e9, nd: int = 64, stage: int = 2, offload: str | None = "cpu", *,
                      dtype: str = "bf16", k: float = 12) -> dict[str, dict[str, float]]:
    """Bytes per rank of each category at each location (device, host, disk), from
    :func:`zerolearn.memory.model.offload_state_bytes` (ZeRO-Offload Sec 4; ZeRO-Infinity Sec 5).

    Returns ``{location: {"params", "grads", "optimizer_states", "total"}}`` in bytes.

    Raises:
        ConfigError: a bad number, offload outside None / "cpu" / "disk", offload at stage 0.
    """
    try:
        placed = offload_state_bytes(psi, nd, stage, offload, dtype, k)
    except ValueError as e:
        raise ConfigError(f"offload_placement: {e}") from None
    return {loc: {**placed[loc], "total": sum(placed[loc].values())} for loc in LOCATIONS}


def offload_figure(psi: float = 7.5e9, nd: int = 64, stage: int = 2, *, dtype: str = "bf16",
                   k: float = 12) -> Figure:
    """One panel per option (no offload, "cpu", "disk"): the bytes per rank each location holds,
    stacked by category, in the paper's decimal GB (:func:`offload_placement`)."""
    options = [None, "cpu", "disk"] if stage else [None]
    fig = Figure(figsize=(3 * len(options) + 1, 3.2), layout="constrained")
    axes = fig.subplots(1, len(options), sharey=True, squeeze=False)[0]
    for ax, option in zip(axes, options, strict=True):
        placed = offload_placement(psi, nd, stage, option, dtype=dtype, k=k)
        bottom = [0.0] * len(LOCATIONS)
        for c in MODEL_CATEGORIES:
            heights = [placed[loc][c] / 1e9 for loc in LOCATIONS]
            ax.bar(LOCATIONS, heights, bottom=bottom, color=COLORS[c], label=readable(c))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, top in enumerate(bottom):
            ax.text(x, top, f"{top:,.1f} GB", ha="center", va="bottom", fontsize=7)
        ax.set_title(f"offload = {option!r}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("bytes per rank (GB, 1e9 bytes)")
    axes[0].set_ylim(0, max(1e-9, math.ceil(max(ax.get_ylim()[1] for ax in axes) * 1.1)))
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"Where each byte lives: {stage_title(stage)}, Psi = {psi / 1e9:g}B, Nd = {nd}, {dtype}, K = {k:g}",
                 fontsize=9)
    return fig
