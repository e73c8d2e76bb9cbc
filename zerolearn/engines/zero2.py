"""Stage 2, P_os+g: partition gradients too (paper Sec 5.2).

A rank only ever updates its shard, so it only needs that shard's averaged
gradient. As each gradient bucket fills during backward, it is reduce-scattered
and the full bucket is freed at once; only the 1/Nd shard survives. Model states:
2 Psi + (2 + K) Psi / Nd bytes (Fig 1). The traffic is unchanged, 2 Psi per step:
reduce_scatter of gradients plus all_gather of updated parameters (Sec 7.2.1).

Freeing each bucket right after its reduction is what puts ZeRO-2's peak below
ZeRO-1's: at most a few buckets of full gradient are alive at any moment, instead
of the whole 2 Psi.
"""

from __future__ import annotations

import torch

from zerolearn import comm
from zerolearn.engines.group import GroupState
from zerolearn.engines.zero1 import Zero1Engine
from zerolearn.memory.ledger import category


class Zero2Engine(Zero1Engine):
    """Stage 2 (P_os+g): full params, sharded grads and optimizer states.

    Memory per rank (bytes): params 2 Psi, grads 2 Psi / Nd, optimizer K Psi / Nd
    (+ padding, + at most a few gradient buckets in flight during backward).
    Traffic per step: reduce_scatter Psi + all_gather Psi elements.
    """

    stage = 2

    def _reduce(self, g: GroupState) -> comm.Handle:
        # The first reduction of a step writes the shard; a later micro-batch's
        # (accumulation) reduces into a temporary and adds it in _after_reduce.
        with category("grads"):
            out = torch.empty(g.layout.shard_numel, dtype=self.dtype, device=self.device)
        if g.grad_shard is None:
            g.grad_shard = out
        else:
            g.reduced = out
        self._track_grad_bytes()
        return comm.reduce_scatter(out, g.grad_full, group=self.pg, async_op=True)

    def _after_reduce(self, g: GroupState) -> None:
        g.grad_full = None  # the full bucket is no longer needed: free it now
        if g.reduced is not None:
            g.grad_shard.add_(g.reduced)
            g.reduced = None

    def _grad_for_step(self, g: GroupState) -> torch.Tensor:
        return g.grad_shard
