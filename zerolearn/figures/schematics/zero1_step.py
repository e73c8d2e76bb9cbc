"""The ZeRO-1 step (P_os, Sec 5.1) on a few numbers: reduce-scatter, update of the shard, all-gather.

Every rank holds all the parameters and its own gradient of them. The flat buffer is padded
to Nd equal shards (:class:`zerolearn.flat.FlatLayout`); the gradients are divided by Nd and
reduce-scattered, so rank r receives the averaged gradient of shard r, which takes shard r's
place in its gradient buffer. ZeRO-1 partitions only the optimizer states: every rank keeps
its whole gradient buffer (2 Psi bytes in fp16, Fig 1), the rest of it still this rank's own,
unreduced gradient, which the step does not read. Rank r's optimizer (torch's SGD here, on a
master shard, as :mod:`zerolearn.engines.zero1` steps it) updates shard r alone; an
all-gather puts the updated shards back together on every rank.
Traffic: Psi reduce-scattered + Psi all-gathered = 2 Psi, the same as DP's all-reduce (Sec 1, Sec 7).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure

from zerolearn.errors import ConfigError, require_count, require_real
from zerolearn.figures.schematics.palette import PADDING_HATCH, box, rank_color
from zerolearn.flat import FlatLayout

__all__ = ["DEFAULT_GRADS", "DEFAULT_PARAMS", "PHASES", "Zero1Frame", "draw_zero1_frame", "zero1_animation",
           "zero1_figure", "zero1_frames"]

PHASES = ("start", "reduce-scatter", "update", "all-gather")
DEFAULT_PARAMS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # 7 parameters: padded to 9 on 3 ranks
DEFAULT_GRADS = [[0.3, 0.6, 0.9, 0.0, 0.3, 0.6, 0.9], [0.6, 0.0, 0.3, 0.9, 0.6, 0.3, 0.0],
                 [0.0, 0.3, 0.6, 0.3, 0.0, 0.9, 0.6]]  # rank r's gradient after its backward


@dataclass(frozen=True)
class Zero1Frame:
    """Every rank's buffers after one phase of the step (elements of the padded flat buffer;
    None where a rank holds nothing).

    Attributes:
        phase: one of :data:`PHASES`.
        params: ``params[r]``, rank r's working parameters (all ``padded_numel``).
        grads: ``grads[r]``, rank r's whole gradient buffer (ZeRO-1 keeps it all): its own
            gradient (start), then with shard r replaced by the mean over ranks.
        master: ``master[r]``, rank r's master shard (its ``shard_range`` of the buffer).
        reduced: ``reduced[r][e]``, element e of ``grads[r]`` holds the mean over ranks (the
            reduce-scatter's output, what the step reads); else it is rank r's own gradient.
    """

    phase: str
    params: list[list[float | None]]
    grads: list[list[float | None]]
    master: list[list[float | None]]
    reduced: list[list[bool]]


def zero1_frames(params: list[float] | None = None, grads: list[list[float]] | None = None, *, nd: int = 3,
                 lr: float = 1.0) -> tuple[tuple[FlatLayout, ...], list[Zero1Frame]]:
    """The four phases of one ZeRO-1 step with SGD (Sec 5.1), on ``nd`` ranks.

    Args:
        params: the parameters (Psi numbers; default :data:`DEFAULT_PARAMS`).
        grads: ``grads[r]``, rank r's gradient, Psi numbers each (default :data:`DEFAULT_GRADS`).
        nd: ranks, 2-8 (must equal ``len(grads)``); lr: SGD's learning rate (> 0).

    Returns:
        ``(layouts, frames)``: each rank's :class:`FlatLayout` (padding, shard range) and the
        four :class:`Zero1Frame` (:data:`PHASES`). The last frame's parameters equal one SGD
        step on the mean gradient, in one process.

    Raises:
        ConfigError: a count or length that does not match, ``lr`` <= 0.
    """
    params = DEFAULT_PARAMS if params is None else params
    grads = DEFAULT_GRADS if grads is None else grads
    require_count("nd", nd, minimum=2)
    require_real("lr", lr)
    if nd > 8 or len(grads) != nd or any(len(g) != len(params) for g in grads) or not params:
        raise ConfigError(f"zero1_frames: nd {nd} with {len(grads)} gradients of lengths {[len(g) for g in grads]} "
                          f"for {len(params)} parameters; allowed: 2 <= nd <= 8, one gradient per rank, each as "
                          "long as params")
    first = FlatLayout.of(["w"], [torch.Size([len(params)])], nd, 0)
    layouts = tuple(dataclasses.replace(first, shard_index=r) for r in range(nd))
    n = first.padded_numel
    full = first.flatten([torch.tensor(params, dtype=torch.float64)], torch.float64, torch.device("cpu"))
    local = [first.flatten([torch.tensor(g, dtype=torch.float64)], torch.float64, torch.device("cpu"))
             for g in grads]
    own = [[False] * n for _ in range(nd)]
    frames = [Zero1Frame("start", [full.tolist()] * nd, [g.tolist() for g in local],
                         [_only(full, lay) for lay in layouts], own)]
    summed = sum(g / nd for g in local)  # the engine divides by Nd before its reduce_scatter
    mine = [[a <= e < b for e in range(n)] for a, b in (lay.shard_range for lay in layouts)]
    # Each rank's buffer keeps its length: shard r takes the mean, the rest stays its own gradient.
    shards = [[m if inside else g for m, g, inside in zip(summed.tolist(), g_r.tolist(), mine[r], strict=True)]
              for r, g_r in enumerate(local)]
    frames.append(Zero1Frame("reduce-scatter", [full.tolist()] * nd, shards, frames[0].master, mine))
    updated = []
    for lay in layouts:  # each rank's own optimizer, on its shard only
        master = torch.nn.Parameter(lay.shard_of(full).clone())
        master.grad = lay.shard_of(summed).clone()
        torch.optim.SGD([master], lr=lr).step()
        updated.append(master.detach())
    masters = [[None] * n for _ in range(nd)]
    for r, (lay, m) in enumerate(zip(layouts, updated, strict=True)):
        a, b = lay.shard_range
        masters[r][a:b] = m.tolist()
    params_after = [[v if a <= i < b else full[i].item() for i, v in enumerate(masters[r])]
                    for r, (a, b) in enumerate(lay.shard_range for lay in layouts)]
    frames.append(Zero1Frame("update", params_after, shards, masters, mine))
    gathered = torch.cat(updated).tolist()
    frames.append(Zero1Frame("all-gather", [gathered] * nd, shards, masters, mine))
    return layouts, frames


def _only(t: torch.Tensor, layout: FlatLayout) -> list[float | None]:
    a, b = layout.shard_range
    return [v if a <= i < b else None for i, v in enumerate(t.tolist())]


_UNREAD = "#d9d9d9"  # a gradient element kept but not read by the step
_WHAT = {"start": "each rank: all parameters, its own whole gradient",
         "reduce-scatter": "reduce-scatter: shard r of rank r's gradient becomes the mean; all of it is kept",
         "update": "update: rank r's SGD steps its master shard with that mean (p - lr g)",
         "all-gather": "all-gather: the updated shards, on every rank"}


def draw_zero1_frame(fig: Figure, layouts: tuple[FlatLayout, ...], frames: list[Zero1Frame], i: int) -> None:
    """Draw phase ``i`` of :func:`zero1_frames` on ``fig``: per rank, its parameters and its
    whole gradient buffer, each element coloured by the rank whose shard it is; padding
    hatched; after the reduce-scatter, the elements the step does not read (a rank's own,
    unreduced gradient outside its shard) grey; "updated" beside a row that changed."""
    frame, nd, n = frames[i], len(layouts), layouts[0].padded_numel
    ax = fig.add_subplot()
    owner = [i // layouts[0].shard_numel for i in range(n)]
    ticks, labels = [], []
    for r in range(nd):
        y0 = (nd - 1 - r) * 2.6
        changed = i > 0 and frames[i - 1].params[r] != frame.params[r]
        for row, (name, values) in enumerate((("params", frame.params[r]), ("grad", frame.grads[r]))):
            y = y0 + 1.1 - row * 1.1
            unread = name == "grad" and i > 0
            for e, v in enumerate(values):
                pad = e >= layouts[0].numel
                grey = unread and not frame.reduced[r][e]
                box(ax, e, y, 0.95, 0.9, _UNREAD if grey else rank_color(owner[e]), "" if v is None else f"{v:.2g}",
                    held=v is not None, hatch=PADDING_HATCH if pad else None, fontsize=6,
                    text_color="0.25" if grey else "white")
            if name == "params" and changed:
                ax.text(n + 0.1, y + 0.45, "updated", va="center", fontsize=7, color="0.2")
            ticks.append(y + 0.45)
            labels.append(f"rank {r} {name}")
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xticks([e + 0.47 for e in range(n)], [str(e) for e in range(n)], fontsize=6)
    ax.set_xlabel("element of the flat buffer (hatched: padding; grey: a rank's own gradient, kept, not read "
                  "by the step)", fontsize=7)
    ax.set_xlim(-0.1, n + 1.5)
    ax.set_ylim(-0.1, nd * 2.6)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"ZeRO-1 step, phase {i + 1} of {len(frames)}: {_WHAT[frame.phase]}", fontsize=8)


def zero1_figure(params: list[float] | None = None, grads: list[list[float]] | None = None, *, nd: int = 3,
                 lr: float = 1.0, phase: int = 3) -> Figure:
    """One phase (index into :data:`PHASES`, default the last) of :func:`zero1_frames` as a Figure."""
    layouts, frames = zero1_frames(params, grads, nd=nd, lr=lr)
    if phase not in range(len(frames)):
        raise ConfigError(f"phase {phase!r}: allowed are 0-{len(frames) - 1} ({', '.join(PHASES)})")
    fig = Figure(figsize=(7, 0.9 * nd + 1.0), layout="constrained")
    draw_zero1_frame(fig, layouts, frames, phase)
    return fig


def zero1_animation(params: list[float] | None = None, grads: list[list[float]] | None = None, *, nd: int = 3,
                    lr: float = 1.0):
    """The four phases as a :class:`~zerolearn.figures.animate.StepThrough`."""
    from zerolearn.figures.animate import step_through

    layouts, frames = zero1_frames(params, grads, nd=nd, lr=lr)
    return step_through(lambda fig, i: draw_zero1_frame(fig, layouts, frames, i), len(frames),
                        figsize=(7.0, 0.9 * nd + 1.0), captions=[_WHAT[f.phase] for f in frames])
