"""Stage 0: data parallelism, the baseline ZeRO improves on (paper Sec 2.1, Sec 7.1).

Every rank holds everything: working parameters, gradients and the optimizer's state
for all Psi parameters, (2 + 2 + K) Psi bytes in mixed precision. After backward the
gradients are averaged with all_reduce, bucket by bucket as they become ready; a ring
all_reduce moves 2 Psi elements per rank (a reduce-scatter then an all-gather). Every
rank then runs the same optimizer step on the same numbers, redundantly: that
redundancy is what ZeRO removes.

The four stage files repeat each other where that lets each one read alone: none
inherits from another, all fill in the contract of :mod:`zerolearn.engines.base`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.base import Bucket, Engine


class DDPEngine(Engine):
    """Stage 0: replicated model states, bucketed all_reduce of gradients.

    Memory per rank (bytes): params 2 Psi, grads 2 Psi, optimizer K Psi (fp32: 4, 4, 8).
    Traffic per step: all_reduce of Psi elements (2 Psi in the paper's count).
    """

    stage = 0
    replicated_grads = True  # after backward every rank holds the whole averaged gradient

    @property
    def num_shards(self) -> int:
        return 1  # nothing is sharded, so nothing needs padding

    # ----- what a rank keeps: everything ---------------------------------------------
    def _init_bucket(self, b: Bucket, master32: torch.Tensor) -> None:
        b.full = master32.to(self.dtype)
        b.layout.bind(b.params, b.full)
        # fp32: the working copy is the master (one tensor, K = 8 for Adam).
        b.master = nn.Parameter(b.full if not self.mixed else master32)

    # ----- backward: each complete bucket is all-reduced ----------------------------
    def _reduce(self, b: Bucket) -> comm.Handle:
        # In place: when it finishes, every rank holds the global-batch mean.
        return comm.all_reduce(b.grad_full, group=self.pg, async_op=True)

    # ----- step: every rank updates everything ----------------------------------------
    def _grad_for_step(self, b: Bucket) -> torch.Tensor:
        return b.grad_full

    def _publish(self, b: Bucket) -> None:
        if self.mixed:
            b.full.copy_(b.master)
