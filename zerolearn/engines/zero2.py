"""Stage 2, P_os+g: partition gradients too (paper Sec 5.2).

A rank only ever updates its shard, so it only needs that shard's averaged gradient.
As each gradient bucket fills during backward, it is reduce-scattered and the full
bucket is freed at once; only the 1/Nd shard survives. Model states:
2 Psi + (2 + K) Psi / Nd bytes (Fig 1). The traffic is unchanged, 2 Psi per step:
reduce_scatter of gradients plus all_gather of updated parameters (Sec 7.2.1).

Freeing each bucket right after its reduction is what puts ZeRO-2's peak below
ZeRO-1's: at most a few buckets of full gradient are alive at any moment
(``MAX_IN_FLIGHT`` reductions in flight), instead of the whole 2 Psi.

The four stage files repeat each other where that lets each one read alone: none
inherits from another, all fill in the contract of :mod:`zerolearn.engines.base`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.base import Bucket, Engine


class Zero2Engine(Engine):
    """Stage 2 (P_os+g): full params, sharded grads and optimizer states.

    Memory per rank (bytes): params 2 Psi, grads 2 Psi / Nd, optimizer K Psi / Nd
    (+ padding, + at most a few gradient buckets in flight during backward).
    Traffic per step: reduce_scatter Psi + all_gather Psi elements.
    """

    stage = 2

    # ----- what a rank keeps: full parameters, this rank's shard of the master --------
    def _init_bucket(self, b: Bucket, master32: torch.Tensor) -> None:
        b.full = master32.to(self.dtype)
        b.layout.bind(b.params, b.full)
        # fp32 without offload: the master is a view of this rank's slice of the working buffer.
        shard = b.layout.shard_of(b.full) if not self.separate_master else b.layout.shard_of(master32).clone()
        b.master = nn.Parameter(shard)

    # ----- backward: reduce-scatter into the kept shard, free the full bucket ---------
    def _reduce(self, b: Bucket) -> comm.Handle:
        # The first reduction of a step writes the shard; a later micro-batch's
        # (accumulation) reduces into a temporary, added in _after_reduce.
        out = self._new_grad(b.layout.shard_numel)
        if b.grad_shard is None:
            b.grad_shard = out
        else:
            b.reduced = out
        return comm.reduce_scatter(out, b.grad_full, group=self.pg, async_op=True, overwrite_input=True)

    def _after_reduce(self, b: Bucket) -> None:
        b.grad_full = None  # the full bucket is no longer needed: free it now
        if b.reduced is not None:
            b.grad_shard.add_(b.reduced)
            b.reduced = None

    # ----- step: update this rank's shard, all_gather every rank's -------------------
    def _grad_for_step(self, b: Bucket) -> torch.Tensor:
        return b.grad_shard

    def _publish(self, b: Bucket) -> None:
        # This rank's slice of the working buffer takes the updated shard (fp32: the master is
        # that slice, already updated; else cast, and copied from the host under offload), and
        # the all_gather runs in place: every rank's slice lands around it, nothing copied.
        mine = b.layout.shard_of(b.full)
        if self.separate_master:
            mine.copy_(b.master.detach())
        self._publishing.append(comm.all_gather(b.full, mine, group=self.pg, async_op=True))
