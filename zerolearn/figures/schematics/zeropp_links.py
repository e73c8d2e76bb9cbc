"""The intra- and inter-node paths of ZeRO++'s qwZ, hpZ and qgZ (Wang et al., arXiv 2306.10209, Sec 3).

Nodes are :class:`zerolearn.zeropp.Nodes`' (``node_ranks`` = k consecutive ranks); each
message is counted as the comm ledger counts it (:mod:`zerolearn.comm`: a call on p ranks whose
tensor has B bytes exchanges B / p with each peer), its bytes from
:func:`zerolearn.zeropp.quantized_bytes` for the quantized ones:

* qwZ, forward all_gather of a unit's m = Psi / W elements per rank: int8 plus fp32 scales,
  from every other rank, inside the node and across;
* hpZ, backward all_gather: the secondary shard, Psi / k elements per rank in the working
  dtype, from the k - 1 other ranks of the node only;
* qgZ, gradient reduce_scatter in two all-to-all hops (``reduce_scatter_quantized``): hop 1
  inside the node, to local rank l the N = W / k chunks of ranks (b, l), int4; hop 2 across
  nodes, the node's partial sum of chunk (b, l) to rank (b, l), int4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from zerolearn.errors import ConfigError, require_count
from zerolearn.figures.schematics.palette import LINK_COLORS, arrow, box, rank_color
from zerolearn.zeropp import DEFAULT_BLOCK, check_nodes, quantized_bytes

__all__ = ["OPTIONS", "Message", "zeropp_figure", "zeropp_paths"]

OPTIONS = ("qwZ", "hpZ", "qgZ")


@dataclass(frozen=True)
class Message:
    """One message: ``src`` -> ``dst`` (global ranks), ``link`` ``"intra"`` or ``"inter"``,
    ``nbytes`` bytes, in ``hop`` (1, or 2 for qgZ's second)."""

    option: str
    src: int
    dst: int
    link: str
    nbytes: int
    hop: int = 1


def zeropp_paths(psi: int = 4096, world_size: int = 4, node_ranks: int = 2, *, dtype_bytes: int = 2,
                 block: int = DEFAULT_BLOCK) -> dict[str, list[Message]]:
    """Every message of qwZ, hpZ and qgZ for one unit of ``psi`` elements (module docstring).

    Returns ``{option: [Message, ...]}``; sum ``nbytes`` by ``link`` for the bytes per link.

    Raises:
        ConfigError: counts < 1, ``node_ranks`` not dividing ``world_size``, ``world_size`` > 8,
            or ``psi`` not a multiple of ``world_size``.
    """
    for name, value in (("psi", psi), ("world_size", world_size), ("dtype_bytes", dtype_bytes), ("block", block)):
        require_count(name, value)
    check_nodes(node_ranks, world_size)
    if world_size > 8 or psi % world_size:
        raise ConfigError(f"psi {psi}, world_size {world_size}: allowed are up to 8 ranks and psi a multiple of "
                          "the world size")
    k, w = node_ranks, world_size
    n_nodes, m = w // k, psi // w

    def link(a: int, b: int) -> str:
        return "intra" if a // k == b // k else "inter"

    out: dict[str, list[Message]] = {o: [] for o in OPTIONS}
    for src in range(w):
        for dst in range(w):
            if src == dst:
                continue
            out["qwZ"].append(Message("qwZ", src, dst, link(src, dst), quantized_bytes(m, 8, block)))
            if link(src, dst) == "intra":
                out["hpZ"].append(Message("hpZ", src, dst, "intra", (psi // k) // k * dtype_bytes))
                if k > 1:  # hop 1: to local rank l, the chunks of ranks (b, l) of every node b
                    out["qgZ"].append(Message("qgZ", src, dst, "intra", quantized_bytes(n_nodes * m, 4, block)))
            elif src % k == dst % k:  # hop 2: the partial sum of chunk (b, l) to rank (b, l)
                out["qgZ"].append(Message("qgZ", src, dst, "inter", quantized_bytes(m, 4, block), hop=2))
    return out


def zeropp_figure(psi: int = 4096, world_size: int = 4, node_ranks: int = 2) -> Figure:
    """One panel per option: the ranks in their nodes, every message an arrow (green inside a
    node, red across), with the bytes per rank on each link (:func:`zeropp_paths`)."""
    paths = zeropp_paths(psi, world_size, node_ranks)
    k, w = node_ranks, world_size
    fig = Figure(figsize=(9, 3.0), layout="constrained")
    axes = fig.subplots(1, len(OPTIONS))
    what = {"qwZ": "forward all_gather, int8", "hpZ": "backward all_gather, node only",
            "qgZ": "gradients: all-to-all, int4, 2 hops"}
    pos = {r: ((r // k) * (k + 1.5) + (r % k), 0.0) for r in range(w)}
    for ax, option in zip(axes, OPTIONS, strict=True):
        for node in range(w // k):
            x0 = node * (k + 1.5) - 0.3
            ax.add_patch(Rectangle((x0, -0.7), k + 0.55, 1.4, fill=False, edgecolor="0.5", linestyle="--"))
            ax.text(x0 + 0.1, 0.8, f"node {node}", fontsize=7)
        for r, (x, y) in pos.items():
            box(ax, x, y - 0.25, 0.9, 0.5, rank_color(r), f"{r}", text_color="white")
        for msg in paths[option]:
            (x0, y0), (x1, y1) = pos[msg.src], pos[msg.dst]
            rad = 0.5 if msg.src < msg.dst else -0.5
            arrow(ax, (x0 + 0.45, y0 + (0.25 if rad > 0 else -0.25)), (x1 + 0.45, y1 + (0.25 if rad > 0 else -0.25)),
                  LINK_COLORS[msg.link], rad=-rad * (0.6 if msg.link == "intra" else 0.3), width=0.8)
        per = {lk: sum(m.nbytes for m in paths[option] if m.link == lk and m.dst == 0) for lk in LINK_COLORS}
        ax.set_title(f"{option}: {what[option]}\nrank 0 receives {per['intra']} B intra, {per['inter']} B inter",
                     fontsize=8)
        ax.set_xlim(-0.6, (w // k) * (k + 1.5))
        ax.set_ylim(-2.2, 2.2)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"ZeRO++ on {w} ranks, {k} per node, one unit of Psi = {psi} elements "
                 f"(green: inside a node, red: across; {math.ceil(psi / w)} elements per shard)", fontsize=9)
    return fig
