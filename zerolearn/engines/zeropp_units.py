"""ZeRO++ on ZeRO-3 (Wang et al., arXiv 2306.10209, Sec 3): which collective (:mod:`zerolearn.zeropp`)
gathers a bucket and which reduces its gradient when an option is on; else ``zero3.py`` calls the plain ones
of Sec 5.3 and 7.2.2 itself."""

from __future__ import annotations

import torch

from zerolearn import comm, zeropp
from zerolearn.errors import ConfigError, require_count
from zerolearn.memory.ledger import category

OPTIONS = ("node_ranks", "qwz_block", "hpz", "qgz")


def refuse_options(stage: int, options: dict) -> None:
    """Raise ConfigError when ZeRO++ options are passed to an engine of a stage other than 3."""
    passed = [f"{k}={options[k]!r}" for k in OPTIONS if k in options]
    if passed and stage != 3:
        raise ConfigError(f"{', '.join(passed)}: ZeRO++ options (node_ranks, qwz_block, hpz, qgz) apply to "
                          f"stage 3 only (ZeRO++ is built on ZeRO-3); this engine is stage {stage}")


class _KeepSecondary:
    """A forward gather in flight; once done, the rank's secondary shard is kept."""

    def __init__(self, handle, owner: ZeroPP, b):
        self.handle, self.owner, self.b = handle, owner, b

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.owner._keep(self.b)


class ZeroPP:
    """A ZeRO-3 engine's ZeRO++ options, checked, and the collectives they choose.

    Args:
        node_ranks: k, consecutive global ranks per node, dividing the world size; None: no nodes.
        qwz_block: qwZ (Sec 3.1): every weight all_gather (backward's too, unless hpZ's) int8 block quantized,
            this many elements per scale; deterministic, so backward uses forward's weights. None: off.
        hpz: hpZ (Sec 3.2): a forward gather (autograd recording) keeps local rank j's secondary shard,
            elements [j P / k, (j + 1) P / k) of a P-element bucket, until its next gather; backward's
            gathers them inside the node (no byte crosses a node; forward's values, dequantized under qwZ).
            Memory: up to Psi / k working-precision elements per rank (``peak_secondary_bytes``).
        qgz: qgZ (Sec 3.3): the gradient reduce_scatter in int4, intra- then inter-node hop, synchronous
            (:func:`zerolearn.zeropp.reduce_scatter_quantized`, block ``qwz_block`` or the default).
        group: the engine's process group (every rank when node_ranks is set).

    Raises:
        ConfigError: a bad value (named, with what is allowed), hpz or qgz without node_ranks, node_ranks
            not dividing the world size, a group of part of the ranks; all before :func:`zeropp.make_nodes`.
    """

    def __init__(self, node_ranks: int | None = None, qwz_block: int | None = None, hpz: bool = False,
                 qgz: bool = False, group=None):
        if node_ranks is not None:
            require_count("node_ranks", node_ranks)
            zeropp.check_nodes(node_ranks, torch.distributed.get_world_size())
        if qwz_block is not None:
            require_count("qwz_block", qwz_block)
        for name, value in (("hpz", hpz), ("qgz", qgz)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r}: must be True or False")
            if value and node_ranks is None:
                raise ConfigError(f"{name}=True needs node_ranks (ranks per node, dividing the world size "
                                  f"{torch.distributed.get_world_size()}): ZeRO++'s {name} works per node")
        self.qwz_block, self.hpz, self.qgz = qwz_block, hpz, qgz
        self.enabled = qwz_block is not None or hpz or qgz  # some option changes a collective
        self.nodes = zeropp.make_nodes(node_ranks, group) if node_ranks is not None else None
        self._secondary: dict[int, torch.Tensor] = {}  # id(bucket) -> its secondary shard
        self.secondary_bytes = self.peak_secondary_bytes = 0

    def gather(self, b, in_backward: bool, group):
        """Launch the all_gather of bucket ``b``'s working parameters into ``b.full`` (already sized) over
        ``group`` (the engine's, or its twin, :func:`zerolearn.comm.phase_group`); a handle with ``wait()``."""
        secondary = self._secondary.pop(id(b), None)  # kept for this gather only
        if secondary is not None:
            self.secondary_bytes -= secondary.nbytes
        if in_backward and secondary is not None:
            if self.nodes.node_ranks == 1:
                b.full.copy_(secondary)
                return comm.Handle(None, "all_gather")
            return comm.all_gather(b.full, secondary, group=self.nodes.intra, async_op=True)
        if self.qwz_block is not None:
            handle = zeropp.all_gather_quantized(b.full, b.shard, self.qwz_block, group, async_op=True)
        else:
            handle = comm.all_gather(b.full, b.shard, group=group, async_op=True)
        keep = self.hpz and not in_backward and torch.is_grad_enabled()
        return _KeepSecondary(handle, self, b) if keep else handle

    def _keep(self, b) -> None:
        piece = b.full.numel() // self.nodes.node_ranks
        start = self.nodes.local * piece
        with category("params"):
            self._secondary[id(b)] = b.full[start:start + piece].clone()
        self.secondary_bytes += piece * b.full.element_size()
        self.peak_secondary_bytes = max(self.peak_secondary_bytes, self.secondary_bytes)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> comm.Handle:
        """qgZ: the sum over ranks of ``inp`` (a bucket's gradient, (padded_numel,), overwritten) into this
        rank's chunk ``out``, (shard_numel,), by a quantized two-hop all-to-all, done on return."""
        zeropp.reduce_scatter_quantized(out, inp, self.nodes, bits=4,
                                        block=self.qwz_block or zeropp.DEFAULT_BLOCK)
        return comm.Handle(None, "all_to_all")
