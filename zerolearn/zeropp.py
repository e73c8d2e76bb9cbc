"""ZeRO++'s collectives: block-quantized all_gather (qwZ), nodes and their process groups
(hpZ), and the two-hop quantized reduce_scatter (qgZ).

ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training", arXiv 2306.10209) cuts the traffic of ZeRO-3 (Sec 7.2.2 of the ZeRO
paper: Psi all-gathered in forward, Psi in backward, Psi reduce-scattered) with three
changes, one per collective (ZeRO++ Sec 3):

* **qwZ** (quantized weights, Sec 3.1): the weight all_gather moves int8 values with one
  fp32 scale per block of ``block`` elements instead of 2-byte values: about half the
  bytes of fp16 (:func:`all_gather_quantized`). Blocks, not one scale per tensor, keep
  the error of each element to half the scale of its own block (:func:`quantize`).
* **hpZ** (hierarchical partitioning, Sec 3.2): every rank also keeps, from forward to
  backward, a secondary shard of each gathered buffer, partitioned over the k ranks of
  its node only; backward's all_gather then runs inside the node and never crosses
  nodes. Memory cost: Psi / k working-precision elements per rank
  (:mod:`zerolearn.engines.zeropp_units`).
* **qgZ** (quantized gradients, Sec 3.3): the gradient reduce_scatter becomes an int4
  quantized all-to-all in two hops, first inside the node, then across nodes, with
  dequantization and summation in between, so only one int4 partial sum per node
  crosses the node boundary (:func:`reduce_scatter_quantized`).

Together (Sec 3, "4x less communication"): 0.5 Psi (int8) + 0 + 0.25 Psi (int4) cross-node
elements' worth of fp16 bytes per step against 3 Psi.

A "node" here is ``node_ranks`` consecutive global ranks (:class:`Nodes`), so one machine
can play several nodes; :func:`zerolearn.comm.set_nodes` makes the ledger count which
bytes cross them. Every collective goes through :mod:`zerolearn.comm` (its ledger and
its guard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolearn import comm, guard
from zerolearn.errors import ConfigError, require_choice, require_count

BITS = (4, 8)
DEFAULT_BLOCK = 256
"""Elements per scale: the package's choice, not DeepSpeed's. DeepSpeed's ZeRO++ quantizer
aims at groups of a few thousand elements (its CUDA quantizer targets under 8,000), where
one fp32 scale costs about 0.05% of the bytes; 256 gives the small models of chapter 8,
whose units hold a few thousand parameters, many blocks each, so that what block scales
buy (one large value spoils only its block) and what they cost (one fp32 scale per 256
int8 values: 1.6% of the int8 bytes) both show."""


def levels(bits: int) -> int:
    """Largest magnitude of a symmetric ``bits``-bit integer code: 2^(bits-1) - 1 (127, 7)."""
    return 2 ** (bits - 1) - 1


def check_quantization(bits: int, block: int) -> None:
    """Raise ConfigError unless ``bits`` is 4 or 8 and ``block`` an integer >= 1."""
    require_choice("bits", bits, BITS)
    require_count("block", block)


# ----- block quantization --------------------------------------------------------------------
def _quantize_rows(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (r, c) quantized independently, blocks never crossing a row.

    Returns ``(q, scales)``: q (r, c) int8 for 8 bits, (r, ceil(c / 2)) uint8 for 4 bits
    (two codes per byte, the even element in the low nibble, each code stored as code + 8);
    scales (r, ceil(c / block)) fp32.
    """
    r, c = x.shape
    nb = math.ceil(c / block)
    padded = torch.zeros(r, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :c] = x
    blocks = padded.view(r, nb, block)
    scales = blocks.abs().amax(dim=2) / levels(bits)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block codes as zeros
    q = torch.round(blocks / safe.unsqueeze(2)).clamp_(-levels(bits), levels(bits)).view(r, nb * block)[:, :c]
    if bits == 8:
        return q.to(torch.int8).contiguous(), scales
    codes = (q + 8).to(torch.uint8)
    if c % 2:
        codes = torch.cat([codes, torch.full((r, 1), 8, dtype=torch.uint8, device=x.device)], dim=1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), scales


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, c: int, bits: int, block: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_quantize_rows`: (r, c) values of ``dtype``."""
    r, nb = scales.shape
    if bits == 8:
        codes = q.to(torch.float32)
    else:
        codes = torch.stack([q & 15, q >> 4], dim=2).reshape(r, -1)[:, :c].to(torch.float32) - 8
    padded = torch.zeros(r, nb * block, dtype=torch.float32, device=q.device)
    padded[:, :c] = codes
    return (padded.view(r, nb, block) * scales.unsqueeze(2)).view(r, nb * block)[:, :c].to(dtype).contiguous()


def quantize(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax block quantization of a 1-D float tensor (ZeRO++ Sec 3.1, qwZ's
    block-based quantization; Sec 3.3 uses it at 4 bits for gradients).

    The n elements are cut into ceil(n / block) blocks of ``block`` consecutive elements
    (the last one shorter); block i gets the scale s_i = max |x| over the block / L with
    L = 2^(bits-1) - 1 (127 for int8, 7 for int4), and each element the code
    round(x / s_i) in [-L, L]. So |x - s_i * code| <= s_i / 2 for every element (up to
    fp32 rounding of x / s_i). An all-zero block has scale 0 and codes 0. A block holding
    an inf or NaN gets a non-finite scale, so it dequantizes to non-finite values: an fp16
    overflow in a gradient still shows after a quantized reduction.

    Args:
        x: (n,) of any floating dtype; computed in fp32.
        bits: 8 (one int8 per element) or 4 (two codes per uint8 byte).
        block: elements per scale, >= 1.

    Returns:
        ``(q, scales)``: q (n,) int8 for 8 bits or (ceil(n / 2),) uint8 for 4 bits
        (element 2j in the low nibble of byte j, element 2j+1 in the high one, each code
        stored as code + 8); scales (ceil(n / block),) fp32.

    Raises:
        ConfigError: ``bits`` not 4 or 8, ``block`` not an integer >= 1, ``x`` not a 1-D
            floating tensor.
    """
    check_quantization(bits, block)
    if x.dim() != 1 or not x.is_floating_point():
        raise ConfigError(f"quantize: x must be a 1-D floating tensor, got {tuple(x.shape)} {x.dtype}")
    q, scales = _quantize_rows(x.detach().float().view(1, -1), bits, block)
    return q.view(-1), scales.view(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 8, block: int = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (n,) values of ``dtype`` that :func:`quantize` (``bits``, ``block``) coded as ``q``, ``scales``.

    Raises:
        ConfigError: bad ``bits`` or ``block``; ``q`` or ``scales`` of the wrong size for n.
    """
    check_quantization(bits, block)
    want_q, want_s = (n if bits == 8 else math.ceil(n / 2)), math.ceil(n / block)
    if q.numel() != want_q or scales.numel() != want_s:
        raise ConfigError(f"dequantize: n={n} at {bits} bits, block {block} needs {want_q} codes and {want_s} "
                          f"scales, got {q.numel()} and {scales.numel()}")
    return _dequantize_rows(q.view(1, -1), scales.view(1, -1), n, bits, block, dtype).view(-1)


def quantized_bytes(n: int, bits: int, block: int) -> int:
    """Bytes :func:`quantize` makes of n elements: codes plus fp32 scales."""
    return (n if bits == 8 else math.ceil(n / 2)) + 4 * math.ceil(n / block)


# ----- nodes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Nodes:
    """This rank's place among nodes of ``node_ranks`` consecutive global ranks.

    Attributes:
        node_ranks: k, ranks per node. world_size: W, ranks in all (a multiple of k).
        rank: this rank's global rank; node = rank // k, local = rank % k.
        intra: process group of this rank's node (k ranks, in rank order); None when
            k = 1 (nothing to exchange inside a node).
        inter: process group of the ranks with this rank's local index, one per node
            (W / k ranks, in node order); None when there is one node.
    """

    node_ranks: int
    world_size: int
    rank: int
    intra: object
    inter: object

    @property
    def node(self) -> int:
        return self.rank // self.node_ranks

    @property
    def local(self) -> int:
        return self.rank % self.node_ranks

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_ranks


def check_nodes(node_ranks: int, world_size: int) -> None:
    """Raise ConfigError unless ``node_ranks`` is an integer >= 1 that divides ``world_size``."""
    require_count("node_ranks", node_ranks)
    if world_size % node_ranks:
        raise ConfigError(f"node_ranks={node_ranks} does not divide the world size {world_size}: every node "
                          f"must hold the same number of ranks (allowed: divisors of {world_size})")


_GROUPS: dict = {}  # (default group, k) -> (intra groups, inter groups): created once per process group


def make_nodes(node_ranks: int, group=None) -> Nodes:
    """This rank's :class:`Nodes` over the ranks of ``group`` (which must be every rank).

    The groups are made with ``dist.new_group``, which every rank of the job must call,
    in the same order: the first call for a given k (in a process group) makes all W / k
    intra-node groups, then all k inter-node groups, on every rank; later calls reuse
    them. A group of one rank is not made (None).

    Raises:
        ConfigError: ``node_ranks`` does not divide the world size (both named), or
            ``group`` is not all the ranks of the job.
    """
    world = dist.get_world_size()
    check_nodes(node_ranks, world)
    if guard.group_ranks(group) != list(range(world)):
        raise ConfigError(f"node_ranks={node_ranks}: ZeRO++'s nodes are cut from all {world} ranks of the job, "
                          f"but the engine's group has ranks {guard.group_ranks(group)}; pass group=None")
    key = (dist.group.WORLD, node_ranks)
    if key not in _GROUPS:
        k, n = node_ranks, world // node_ranks
        intra = [dist.new_group(list(range(a * k, (a + 1) * k))) if k > 1 else None for a in range(n)]
        inter = [dist.new_group(list(range(j, world, k))) if n > 1 else None for j in range(k)]
        _GROUPS[key] = (intra, inter)
    intra, inter = _GROUPS[key]
    rank = dist.get_rank()
    return Nodes(node_ranks, world, rank, intra[rank // node_ranks], inter[rank % node_ranks])


# ----- qwZ: the quantized all_gather -------------------------------------------------------------
class QuantizedGather:
    """An all_gather of int8 codes and fp32 scales in flight; :meth:`wait` dequantizes into ``out``."""

    def __init__(self, out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, handles: list,
                 ranks: int, piece: int, block: int):
        self.out, self.codes, self.scales, self.handles = out, codes, scales, handles
        self.ranks, self.piece, self.block = ranks, piece, block

    def wait(self) -> None:
        if self.handles is None:
            return
        for h in self.handles:
            h.wait()
        p = self.ranks
        self.out.copy_(_dequantize_rows(self.codes.view(p, self.piece), self.scales.view(p, -1), self.piece, 8,
                                        self.block, self.out.dtype).view(-1))
        self.handles = self.codes = self.scales = None


def all_gather_quantized(out: torch.Tensor, shard: torch.Tensor, block: int = DEFAULT_BLOCK, group=None,
                         async_op: bool = False) -> QuantizedGather:
    """qwZ (ZeRO++ Sec 3.1): ``out`` (p * m elements) = every rank's ``shard`` (m), in rank
    order, each through int8 block quantization (:func:`quantize`, 8 bits).

    Two all_gathers through :mod:`zerolearn.comm`: the codes (p * m int8) and the scales
    (p * ceil(m / block) fp32), so the ledger counts the bytes that really move:
    m + 4 ceil(m / block) per rank's piece against 2 m for fp16. Every rank, this one
    included, gets the dequantized values, so all ranks hold the same weights; the
    error per element is at most half its block's scale.

    Returns:
        a handle whose ``wait()`` finishes the gathers and writes ``out`` (already done
        unless ``async_op``).

    Raises:
        ConfigError: ``block`` not an integer >= 1; ``out`` not p times ``shard``'s size.
    """
    require_count("block", block)
    p, m = dist.get_world_size(group), shard.numel()
    if out.numel() != p * m:
        raise ConfigError(f"all_gather_quantized: out has {out.numel()} elements, {p} ranks x {m} needed")
    q, s = _quantize_rows(shard.detach().float().view(1, -1), 8, block)
    codes = torch.empty(p * m, dtype=torch.int8, device=shard.device)
    scales = torch.empty(p * s.numel(), dtype=torch.float32, device=shard.device)
    handles = [comm.all_gather(codes, q.view(-1), group=group, async_op=async_op),
               comm.all_gather(scales, s.view(-1), group=group, async_op=async_op)]
    handle = QuantizedGather(out, codes, scales, handles, p, m, block)
    if not async_op:
        handle.wait()
    return handle


# ----- qgZ: the two-hop quantized reduce_scatter --------------------------------------------------
def _exchange(rows: torch.Tensor, group, bits: int, block: int) -> torch.Tensor:
    """Row j of ``rows`` (p, c) quantized and sent to group rank j; returns the p rows
    received (row i from group rank i), dequantized, fp32 (p, c)."""
    p, c = rows.shape
    q, s = _quantize_rows(rows, bits, block)
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    comm.all_to_all(q_in.view(-1), q.contiguous().view(-1), group=group)
    comm.all_to_all(s_in.view(-1), s.contiguous().view(-1), group=group)
    return _dequantize_rows(q_in, s_in, c, bits, block, torch.float32)


def reduce_scatter_quantized(out: torch.Tensor, inp: torch.Tensor, nodes: Nodes, bits: int = 4,
                             block: int = DEFAULT_BLOCK) -> None:
    """qgZ (ZeRO++ Sec 3.3): ``out`` (m elements) = this rank's chunk of the sum over all
    W ranks of ``inp`` (W * m), chunk g for global rank g, up to quantization error.

    Two hops of quantized all-to-all (:func:`zerolearn.comm.all_to_all`), each followed
    by dequantization and an fp32 sum:

    1. inside the node (k ranks): rank (a, j) (node a, local index j) sends local rank l
       its values of the chunks of ranks (b, l) for every node b (N = W / k chunks, the
       paper's tensor slice reordering); rank (a, l) sums the k pieces it receives: node
       a's partial sums of those N chunks;
    2. across nodes (the N ranks of local index l): the partial sum of chunk (b, l) goes,
       requantized, to node b; rank (b, l) sums the N pieces into ``out``.

    Per rank, hop 1 moves (k - 1) N m elements inside the node and hop 2 (N - 1) m across
    nodes, at ``bits`` per element plus one fp32 scale per ``block``. A hop over one rank
    (k = 1, or one node) is skipped: no exchange and no quantization.

    Error per element: at most half a scale per quantization it went through, summed:
    |error| <= sum over ranks of s1 / 2 + sum over nodes of s2 / 2, s1 the scale of the
    element's block in a rank's input, s2 in a node's partial sum (:func:`error_bound`).

    Raises:
        ConfigError: bad ``bits`` or ``block``; ``inp`` not W times ``out``'s size.
    """
    check_quantization(bits, block)
    k, n_nodes, m = nodes.node_ranks, nodes.num_nodes, out.numel()
    if inp.numel() != nodes.world_size * m:
        raise ConfigError(f"reduce_scatter_quantized: inp has {inp.numel()} elements, "
                          f"{nodes.world_size} ranks x {m} needed")
    x = inp.detach().float().view(n_nodes, k, m)  # x[b, l]: the chunk of global rank b * k + l
    if k > 1:  # hop 1: to local rank l its N chunks (b, l), b = 0..N-1
        partial = _exchange(x.transpose(0, 1).reshape(k, n_nodes * m), nodes.intra, bits, block)
        partial = partial.sum(dim=0).view(n_nodes, m)  # this node's sums of chunks (b, self.local)
    else:
        partial = x[:, 0]
    if n_nodes > 1:  # hop 2: the node's partial sum of chunk (b, l) to node b
        partial = _exchange(partial, nodes.inter, bits, block).sum(dim=0, keepdim=True)
    out.copy_(partial.view(-1))


def error_bound(absmax: float, world_size: int, node_ranks: int, bits: int = 4) -> float:
    """A bound on :func:`reduce_scatter_quantized`'s error per element when every input
    element is at most ``absmax`` in magnitude: each rank's block scale is at most
    absmax / L (L = 2^(bits-1) - 1), so hop 1 adds at most W absmax / (2L) (when k > 1); a
    dequantized value is at most its block's absmax (|code| <= L), so a node's partial sum
    is at most k absmax and hop 2 (when there are several nodes) adds at most
    N k absmax / (2L). In elements of the sum's units (no 1 / W: the engine divides first)."""
    L, k = levels(bits), node_ranks
    n = world_size // k
    hop1 = world_size * absmax / (2 * L) if k > 1 else 0.0
    hop2 = n * k * absmax / (2 * L) if n > 1 else 0.0  # a dequantized value is at most its block's absmax
    return hop1 + hop2
