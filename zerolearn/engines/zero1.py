"""Stage 1, P_os: partition the optimizer states (paper Sec 5.1).

Each rank keeps the full working parameters and the full gradient, as in DP, but
only its 1/Nd shard of the optimizer state (fp32 master, Adam's two moments):
4 Psi + K Psi / Nd bytes in mixed precision (Fig 1). Gradients are
reduce-scattered, so each rank receives the average of just the shard it updates
(Psi elements moved); after the step, an all_gather of the updated shards
rebuilds the full parameters (Psi more). 2 Psi per step, the same as DP's
all_reduce (Sec 7.2.1). (An all_reduce followed by a broadcast of each owner's
parameters would move 3 Psi.)
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.base import MAX_IN_FLIGHT, Engine
from zerolearn.engines.group import GroupState
from zerolearn.memory.ledger import category


class Zero1Engine(Engine):
    """Stage 1 (P_os): full params and grads, sharded optimizer states.

    Memory per rank (bytes): params 2 Psi, grads 2 Psi, optimizer K Psi / Nd (+ padding).
    Traffic per step: reduce_scatter Psi + all_gather Psi elements.
    """

    stage = 1

    def _init_group(self, g: GroupState, master32: torch.Tensor) -> None:
        g.full = master32.to(self.dtype)
        g.layout.bind(g.params, g.full)
        # fp32: the master is a view of this rank's slice of the working buffer.
        shard = g.layout.shard_of(g.full) if not self.mixed else g.layout.shard_of(master32).clone()
        g.master = nn.Parameter(shard)

    def _reduce(self, g: GroupState) -> comm.Handle:
        g.reduced = torch.empty(g.layout.shard_numel, dtype=self.dtype, device=self.device)
        return comm.reduce_scatter(g.reduced, g.grad_full, group=self.pg, async_op=True)

    def _after_reduce(self, g: GroupState) -> None:
        # Keep the reduced shard in place inside the full gradient buffer: stage 1
        # does not partition gradients, so the buffer stays allocated (2 Psi).
        mine = g.layout.shard_of(g.grad_full)
        mine.copy_(g.reduced)
        g.reduced = None
        if g.grad_shard is not None:  # an earlier micro-batch's reduced gradient
            mine.add_(g.grad_shard)
            g.grad_shard = None

    def _keep_reduced(self, g: GroupState) -> None:
        # The buffer holds the reduced shard and this rank's unreduced rest; the next
        # backward adds into it, so move the shard aside (Psi / Nd elements, only while
        # accumulating) and start from zeros.
        if g.grad_full is not None:
            with category("grads"):
                g.grad_shard = g.layout.shard_of(g.grad_full).clone()
            g.grad_full.zero_()

    def _grad_for_step(self, g: GroupState) -> torch.Tensor:
        return g.layout.shard_of(g.grad_full)

    def _publish(self, g: GroupState) -> None:
        updated = g.master.detach().to(self.dtype, copy=True)
        self._publishing.append(comm.all_gather(g.full, updated, group=self.pg, async_op=True))
        # Each gather in flight pins its updated shard: keep only a few alive at once.
        while len(self._publishing) > MAX_IN_FLIGHT:
            self._publishing.pop(0).wait()
