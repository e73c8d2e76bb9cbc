"""The one palette of the schematics: a colour per rank, the same in every drawing, and the
small drawing helpers they share (a labelled box, a faint box for what a rank does not hold).

A rank's colour marks what it *owns* (its shard, the chunk it sends, the block of a weight
it keeps), so "rank 1's slice" is the same orange in Fig 1's layout, the ring, the ZeRO-1
step and Megatron's split.
"""

from __future__ import annotations

from matplotlib.patches import FancyArrowPatch, Rectangle

from zerolearn.errors import require_count

__all__ = ["FAINT", "LINK_COLORS", "PADDING_HATCH", "RANK_COLORS", "arrow", "box", "rank_color"]

RANK_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
"""Colour of rank r: ``RANK_COLORS[r % 8]`` (Tableau 10, without its grey and pink)."""
FAINT = "#eeeeee"  # what a rank does not hold: drawn, but empty
PADDING_HATCH = "////"  # the zeros that pad a flat buffer to equal shards (Sec 5)
LINK_COLORS = {"intra": "#59a14f", "inter": "#e15759"}  # inside a node / across nodes (ZeRO++)


def rank_color(rank: int) -> str:
    """The colour of ``rank`` (an integer >= 0) in every schematic.

    Raises:
        ConfigError: ``rank`` is not an integer >= 0.
    """
    require_count("rank", rank, minimum=0)
    return RANK_COLORS[rank % len(RANK_COLORS)]


def box(ax, x: float, y: float, w: float, h: float, color: str, text: str = "", *, held: bool = True,
        hatch: str | None = None, fontsize: float = 7, text_color: str = "black") -> None:
    """A rectangle at ``(x, y)`` of ``w`` x ``h`` data units, filled with ``color`` (``held``) or
    faint with a coloured edge (not held), with ``text`` centred in it."""
    face = color if held else FAINT
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=color if not held else "white",
                           linewidth=0.8, hatch=hatch))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=text_color if held else "0.5")


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str, *, rad: float = 0.0,
          width: float = 1.2, style: str = "-|>") -> None:
    """An arrow from ``start`` to ``end`` (data units), bent by ``rad`` (0: straight)."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color=color, linewidth=width,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))
