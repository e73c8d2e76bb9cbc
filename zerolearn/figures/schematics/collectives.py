"""The five collectives of Sec 7 as before / after per rank, and the ring all-reduce step by step.

Each rank holds Nd chunks (one small number each, so a drawing can print them). The
collectives' results are computed here on those numbers, with the meaning
:mod:`zerolearn.comm` gives each call: an all_gather's output is every rank's input in rank
order, a reduce_scatter leaves rank r chunk r of the sum, and so on. The ring all-reduce is
simulated message by message: Nd - 1 steps of reduce-scatter (each rank sends one chunk to
its right neighbour, who adds it) then Nd - 1 steps of all-gather (the completed chunks go
round, overwriting): 2 (Nd - 1) steps, each rank sending 1/Nd of the data per step, so
2 (Nd - 1) / Nd of it in all (Sec 7.1: an all-reduce is a reduce-scatter plus an
all-gather, 2 Psi).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.patches import Patch

from zerolearn.errors import ConfigError, require_choice, require_count
from zerolearn.figures.schematics.palette import arrow, box, rank_color

__all__ = ["COLLECTIVES", "SUM_GREY", "CollectiveState", "RingStep", "collective", "collectives_figure",
           "draw_ring_step", "ring_all_reduce", "ring_animation", "ring_chunk_color", "ring_figure", "ring_legend",
           "start_values"]

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather")
Chunks = list[list[float | None]]  # [rank][chunk], None: the rank holds nothing there
SUM_GREY = "0.45"  # a chunk that sums every rank's values; one rank's own value has the rank's colour


def start_values(nd: int) -> list[list[float]]:
    """Rank r's chunk c starts as ``10 (r + 1) + c``: small, distinct, readable."""
    _check_nd(nd)
    return [[10.0 * (r + 1) + c for c in range(nd)] for r in range(nd)]


def _check_nd(nd: int) -> None:
    require_count("nd", nd, minimum=2)
    if nd > 8:
        raise ConfigError(f"nd {nd}: allowed are 2 to 8 ranks in a drawing")


def _check_values(values: list[list[float]]) -> int:
    nd = len(values)
    _check_nd(nd)
    if any(len(row) != nd for row in values):
        raise ConfigError(f"values: {[len(r) for r in values]} chunks per rank; allowed: Nd = {nd} chunks on "
                          "each of the Nd ranks")
    return nd


@dataclass(frozen=True)
class CollectiveState:
    """One collective on Nd ranks: ``before[r][c]`` and ``after[r][c]`` (None: not held / not
    defined), ``root`` the source (broadcast) or destination (reduce) rank."""

    op: str
    before: Chunks
    after: Chunks
    root: int = 0


def collective(op: str, values: list[list[float]] | None = None, nd: int = 3, root: int = 0) -> CollectiveState:
    """What ``op`` (one of :data:`COLLECTIVES`) does to ``values`` (``[rank][chunk]``, Nd x Nd;
    default :func:`start_values`), as :mod:`zerolearn.comm` defines each call.

    Inputs that the collective does not read are shown as None in ``before``: a broadcast reads
    only the root's data, an all_gather only chunk r of rank r (its shard).

    Raises:
        ConfigError: unknown ``op``, ``nd`` outside 2-8, ``values`` not Nd x Nd, ``root`` not a rank.
    """
    require_choice("op", op, COLLECTIVES)
    values = start_values(nd) if values is None else values
    nd = _check_values(values)
    require_choice("root", root, tuple(range(nd)))
    total = [sum(values[r][c] for r in range(nd)) for c in range(nd)]
    before: Chunks = [list(row) for row in values]
    if op == "broadcast":
        before = [list(values[r]) if r == root else [None] * nd for r in range(nd)]
        after: Chunks = [list(values[root]) for _ in range(nd)]
    elif op == "reduce":
        after = [list(total) if r == root else list(values[r]) for r in range(nd)]
    elif op == "all_reduce":
        after = [list(total) for _ in range(nd)]
    elif op == "reduce_scatter":
        after = [[total[c] if c == r else None for c in range(nd)] for r in range(nd)]
    else:  # all_gather: rank r contributes its shard, chunk r
        before = [[values[r][c] if c == r else None for c in range(nd)] for r in range(nd)]
        after = [[values[c][c] for c in range(nd)] for _ in range(nd)]
    return CollectiveState(op, before, after, root)


def _draw_chunks(ax, chunks: Chunks, colors: list[list[str]], x0: float) -> None:
    nd = len(chunks)
    for r, row in enumerate(chunks):
        for c, v in enumerate(row):
            box(ax, x0 + c, nd - 1 - r, 0.92, 0.85, colors[r][c], "" if v is None else f"{v:g}", held=v is not None)


def collectives_figure(nd: int = 3) -> Figure:
    """The five collectives, one row each: every rank's Nd chunks before and after
    (:func:`collective`); a chunk is coloured by the rank whose data it carries (a sum: grey)."""
    _check_nd(nd)
    fig = Figure(figsize=(7, 1.2 * nd / 3 * len(COLLECTIVES) + 0.6), layout="constrained")
    axes = fig.subplots(len(COLLECTIVES), 1)
    for ax, op in zip(axes, COLLECTIVES, strict=True):
        state = collective(op, nd=nd)
        summed = {"reduce": [[r == state.root] * nd for r in range(nd)], "all_reduce": [[True] * nd] * nd,
                  "reduce_scatter": [[True] * nd] * nd}.get(op, [[False] * nd] * nd)
        src = [[state.root if op == "broadcast" else (c if op == "all_gather" else r) for c in range(nd)]
               for r in range(nd)]
        before = [[rank_color(src[r][c] if op != "all_gather" else r) for c in range(nd)] for r in range(nd)]
        after = [[SUM_GREY if summed[r][c] else rank_color(src[r][c]) for c in range(nd)] for r in range(nd)]
        _draw_chunks(ax, state.before, before, 0)
        _draw_chunks(ax, state.after, after, nd + 2)
        arrow(ax, (nd + 0.2, nd / 2), (nd + 1.8, nd / 2), "0.3", width=2)
        ax.set_xlim(-0.1, 2 * nd + 2.1)
        ax.set_ylim(-0.1, nd)
        ax.set_yticks([nd - 1 - r + 0.42 for r in range(nd)], [f"rank {r}" for r in range(nd)], fontsize=7)
        ax.set_xticks([])
        ax.set_title(op + (f" (root: rank {state.root})" if op in ("broadcast", "reduce") else ""), fontsize=8,
                     loc="left")
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"The collectives on Nd = {nd} ranks: before (left) and after (right); grey: a sum", fontsize=9)
    return fig


# ----- the ring all-reduce ----------------------------------------------------------------------
@dataclass(frozen=True)
class RingStep:
    """One step of the ring: ``sends[r] = (chunk, value)`` rank r sends to rank (r + 1) % Nd,
    and ``after[r][c]``, every rank's chunks once the step is done; ``summed[r][c]``, the ranks
    whose starting values ``after[r][c]`` adds up (sorted). ``phase`` is ``"reduce-scatter"``
    (the receiver adds) or ``"all-gather"`` (the receiver overwrites)."""

    index: int
    phase: str
    sends: list[tuple[int, float]]
    after: list[list[float]]
    summed: list[list[tuple[int, ...]]]


def ring_all_reduce(values: list[list[float]] | None = None, nd: int = 3) -> tuple[list[list[float]], list[RingStep]]:
    """The ring all-reduce of ``values`` (``[rank][chunk]``, Nd x Nd; default :func:`start_values`).

    Step s of the reduce-scatter phase (s = 0 .. Nd - 2): rank r sends chunk (r - s) mod Nd to
    rank r + 1, which adds it to its own; after it rank r holds the complete sum of chunk
    (r + 1) mod Nd. Step s of the all-gather phase: rank r sends chunk (r + 1 - s) mod Nd,
    which the receiver copies. Every message is one chunk, 1/Nd of the data.

    Returns:
        ``(start, steps)``: the values before the first step, and the 2 (Nd - 1) steps.

    Raises:
        ConfigError: ``values`` not Nd x Nd with 2 <= Nd <= 8.
    """
    values = start_values(nd) if values is None else values
    nd = _check_values(values)
    state = [list(map(float, row)) for row in values]
    summed = [[(r,)] * nd for r in range(nd)]  # whose values each chunk holds: at first, its rank's own
    start = [list(row) for row in state]
    steps = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(nd - 1):
            shift = s if phase == "reduce-scatter" else s - 1
            sends = [((r - shift) % nd, state[r][(r - shift) % nd]) for r in range(nd)]
            sent = [summed[r][c] for r, (c, _) in enumerate(sends)]
            for r, (c, v) in enumerate(sends):  # every message of a step travels at once
                dst = (r + 1) % nd
                if phase == "reduce-scatter":
                    state[dst][c], summed[dst][c] = state[dst][c] + v, tuple(sorted({*summed[dst][c], *sent[r]}))
                else:
                    state[dst][c], summed[dst][c] = v, sent[r]
            steps.append(RingStep(len(steps), phase, sends, [list(row) for row in state],
                                  [list(row) for row in summed]))
    return start, steps


def _ring_positions(nd: int) -> list[tuple[float, float]]:
    return [(math.cos(math.pi / 2 - 2 * math.pi * r / nd) * 3.2, math.sin(math.pi / 2 - 2 * math.pi * r / nd) * 2.4)
            for r in range(nd)]


def ring_chunk_color(ranks: tuple[int, ...], nd: int) -> str:
    """The colour of a chunk that adds up the starting values of ``ranks``: one rank's own value
    in that rank's colour; a partial sum in a grey, lighter the fewer ranks it adds; the sum of
    all ``nd`` ranks in :data:`SUM_GREY`, the grey of :func:`collectives_figure`."""
    if len(ranks) == 1:
        return rank_color(ranks[0])
    if len(ranks) == nd:
        return SUM_GREY
    return f"{float(SUM_GREY) + 0.4 * (nd - len(ranks)) / (nd - 1):.3f}"


def _ring_text_color(color: str) -> str:  # white on the rank colours and dark greys, black on light greys
    return "black" if color.startswith("0.") and float(color) > 0.6 else "white"


def ring_legend(nd: int) -> tuple[list, list[str]]:
    """Handles and labels of the ring's colours (:func:`ring_chunk_color`) for ``Figure.legend``
    or ``Axes.legend``, with ``handler_map={tuple: HandlerTuple(ndivide=None)}``."""
    handles: list = [tuple(Patch(color=rank_color(r)) for r in range(nd))]
    labels = ["a rank's own value"]
    for k in range(2, nd + 1):
        handles.append(Patch(color=ring_chunk_color(tuple(range(k)), nd)))
        labels.append(f"sum of all {nd} ranks" if k == nd else f"sum of {k} ranks")
    return handles, labels


def draw_ring_step(ax, start: list[list[float]], steps: list[RingStep], i: int, *, legend: bool = False) -> None:
    """Draw the ring after ``i`` steps (0: before any) on ``ax``: each rank's chunks, the
    messages of step ``i`` as arrows labelled with the chunk and value sent. A chunk (and the
    message carrying it) is coloured by the ranks it adds up (:func:`ring_chunk_color`);
    ``legend``: the colours' legend right of the ring."""
    nd = len(start)
    state = start if i == 0 else steps[i - 1].after
    summed = [[(r,)] * nd for r in range(nd)] if i == 0 else steps[i - 1].summed
    pos = _ring_positions(nd)
    for r, (x, y) in enumerate(pos):
        ax.text(x, y + 0.75, f"rank {r}", ha="center", fontsize=8, color=rank_color(r), weight="bold")
        for c in range(nd):
            color = ring_chunk_color(summed[r][c], nd)
            box(ax, x - nd * 0.5 + c, y - 0.4, 0.95, 0.8, color, f"{state[r][c]:g}", text_color=_ring_text_color(color))
    if i < len(steps):
        step = steps[i]
        for r, (c, v) in enumerate(step.sends):
            (x0, y0), (x1, y1) = pos[r], pos[(r + 1) % nd]
            color = ring_chunk_color(summed[r][c], nd)
            arrow(ax, (x0 * 0.7, y0 * 0.7), (x1 * 0.7, y1 * 0.7), color, rad=-0.25, width=1.6)
            # The label sits on the arc's middle (arc3's Bezier at t = 1/2: the chord's middle moved by
            # rad / 2 across it) and reads away from the ring's centre, so labels never cross.
            dx, dy = (x1 - x0) * 0.7, (y1 - y0) * 0.7
            lx, ly = (x0 + x1) * 0.35 - 0.125 * dy, (y0 + y1) * 0.35 + 0.125 * dx
            ha = "left" if lx > 0.1 else "right" if lx < -0.1 else "center"
            ax.text(lx, ly, f"chunk {c}: {v:g}", fontsize=7, ha=ha, va="center",
                    color=color if len(summed[r][c]) == 1 else "0.2",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85})
        what = (f"step {i + 1}/{len(steps)}, {step.phase}:\nthe receiver "
                + ("adds the chunk" if step.phase == "reduce-scatter" else "copies the chunk"))
    else:
        what = f"done after 2 (Nd - 1) = {len(steps)} steps:\nevery rank holds the sums (dark grey)"
    ax.set_title(what, fontsize=8)
    ax.set_xlim(-3.2 - nd * 0.6, 3.2 + nd * 0.6)
    ax.set_ylim(-3.2, 3.4)
    ax.set_aspect("equal")
    ax.axis("off")
    if legend:
        ax.legend(*ring_legend(nd), handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, fontsize=7,
                  loc="center left", bbox_to_anchor=(1.0, 0.5), title="a chunk's colour", title_fontsize=7,
                  frameon=False)


def ring_figure(nd: int = 3, values: list[list[float]] | None = None) -> Figure:
    """Every step of the ring all-reduce side by side (:func:`ring_all_reduce`), 2 (Nd - 1) + 1 panels."""
    start, steps = ring_all_reduce(values, nd)
    n = len(steps) + 1
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = Figure(figsize=(3.4 * cols, 2.9 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for i, ax in enumerate(axes):
        if i < n:
            draw_ring_step(ax, start, steps, i)
        else:
            ax.axis("off")
    fig.suptitle(f"Ring all-reduce on Nd = {len(start)} ranks; a chunk's colour: whose values it adds up",
                 fontsize=9)
    fig.legend(*ring_legend(len(start)), handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, fontsize=7,
               loc="outside lower center", ncols=len(start), frameon=False)
    return fig


def ring_animation(nd: int = 3, values: list[list[float]] | None = None):
    """The ring as a :class:`~zerolearn.figures.animate.StepThrough`: 2 (Nd - 1) + 1 frames."""
    from zerolearn.figures.animate import step_through

    start, steps = ring_all_reduce(values, nd)

    def draw(fig: Figure, i: int) -> None:
        draw_ring_step(fig.add_subplot(), start, steps, i, legend=True)

    captions = [f"step {i + 1}: {s.phase}" for i, s in enumerate(steps)] + ["done: every rank holds the sum"]
    return step_through(draw, len(steps) + 1, figsize=(7.6, 4.2), captions=captions)
