"""Stage 1, P_os: partition the optimizer states (paper Sec 5.1).

Each rank keeps the full working parameters and the full gradient, as in DP, but only
its 1/Nd shard of the optimizer state (fp32 master, Adam's two moments):
4 Psi + K Psi / Nd bytes in mixed precision (Fig 1). Gradients are reduce-scattered,
so each rank receives the average of just the shard it updates (Psi elements moved);
after the step, an all_gather of the updated shards rebuilds the full parameters (Psi
more). 2 Psi per step, the same as DP's all_reduce: the paper says P_os keeps DP's
communication volume (Sec 1, Sec 7); this schedule is the book's, as the paper writes
out none for P_os alone. (An all_reduce followed by a broadcast of each owner's
parameters would move 3 Psi.)

The four stage files repeat each other where that lets each one read alone: none
inherits from another, all fill in the contract of :mod:`zerolearn.engines.base`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.base import Bucket, Engine


class Zero1Engine(Engine):
    """Stage 1 (P_os): full params and grads, sharded optimizer states.

    Memory per rank (bytes): params 2 Psi, grads 2 Psi, optimizer K Psi / Nd (+ padding).
    Traffic per step: reduce_scatter Psi + all_gather Psi elements.
    """

    stage = 1

    # ----- what a rank keeps: full parameters, this rank's shard of the master --------
    def _init_bucket(self, b: Bucket, master32: torch.Tensor) -> None:
        b.full = master32.to(self.dtype)
        b.layout.bind(b.params, b.full)
        # fp32 without offload: the master is a view of this rank's slice of the working buffer.
        shard = b.layout.shard_of(b.full) if not self.separate_master else b.layout.shard_of(master32).clone()
        b.master = nn.Parameter(shard)

    # ----- backward: reduce-scatter; the reduced shard stays in the full buffer --------
    def _reduce(self, b: Bucket) -> comm.Handle:
        b.reduced = torch.empty(b.layout.shard_numel, dtype=self.dtype, device=self.device)
        return comm.reduce_scatter(b.reduced, b.grad_full, group=self.pg, async_op=True, overwrite_input=True)

    def _after_reduce(self, b: Bucket) -> None:
        # Stage 1 does not partition gradients: the full buffer stays allocated (2 Psi),
        # with this rank's reduced shard in its place.
        mine = b.layout.shard_of(b.grad_full)
        mine.copy_(b.reduced)
        b.reduced = None
        if b.grad_shard is not None:  # an earlier micro-batch's reduced gradient
            mine.add_(b.grad_shard)
            b.grad_shard = None

    def _keep_reduced(self, b: Bucket) -> None:
        # Another backward will add into the buffer, which holds the reduced shard and this
        # rank's unreduced rest: set the shard aside (Psi / Nd elements) and start from zeros.
        if b.grad_full is not None:
            b.grad_shard = self._new_grad(b.layout.shard_numel)
            b.grad_shard.copy_(b.layout.shard_of(b.grad_full))
            b.grad_full.zero_()

    # ----- step: update this rank's shard, all_gather every rank's -------------------
    def _grad_for_step(self, b: Bucket) -> torch.Tensor:
        return b.layout.shard_of(b.grad_full)

    def _publish(self, b: Bucket) -> None:
        # This rank's slice of the working buffer takes the updated shard (fp32: the master is
        # that slice, already updated; else cast, and copied from the host under offload), and
        # the all_gather runs in place: every rank's slice lands around it, nothing copied.
        mine = b.layout.shard_of(b.full)
        if self.separate_master:
            mine.copy_(b.master.detach())
        self._publishing.append(comm.all_gather(b.full, mine, group=self.pg, async_op=True))
