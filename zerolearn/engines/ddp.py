"""Stage 0: data parallelism, the baseline ZeRO improves on (paper Sec 2.1, Sec 7.1).

Every rank holds everything: working parameters, gradients and the optimizer's
state for all Psi parameters, (2 + 2 + K) Psi bytes in mixed precision. After
backward the gradients are averaged with all_reduce, bucket by bucket as they
become ready; a ring all_reduce moves 2 Psi elements per rank (a reduce-scatter
then an all-gather). Every rank then runs the same optimizer step on the same
numbers, redundantly: that redundancy is what ZeRO removes.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.base import Engine
from zerolearn.engines.group import GroupState


class DDPEngine(Engine):
    """Stage 0: replicated model states, bucketed all_reduce of gradients.

    Memory per rank (bytes): params 2 Psi, grads 2 Psi, optimizer K Psi (fp32: 4, 4, 8).
    Traffic per step: all_reduce of Psi elements (2 Psi in the paper's count).
    """

    stage = 0

    @property
    def num_shards(self) -> int:
        return 1  # nothing is sharded, so nothing needs padding

    def _init_group(self, g: GroupState, master32: torch.Tensor) -> None:
        g.full = master32.to(self.dtype)
        g.layout.bind(g.params, g.full)
        # fp32: the working copy is the master (one tensor, K = 8 for Adam).
        g.master = nn.Parameter(g.full if not self.mixed else master32)

    def _reduce(self, g: GroupState) -> comm.Handle:
        # In place: when it finishes, every rank holds the global-batch mean (the
        # default _after_reduce, nothing to do).
        return comm.all_reduce(g.grad_full, group=self.pg, async_op=True)

    def _grad_for_step(self, g: GroupState) -> torch.Tensor:
        return g.grad_full

    def _publish(self, g: GroupState) -> None:
        if self.mixed:
            g.full.copy_(g.master)
