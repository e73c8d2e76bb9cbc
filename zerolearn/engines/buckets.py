"""Gradient buckets from autograd hooks (paper Sec 5.2): the backward of every stage.

Each flat group is a bucket of at most ``bucket_mb``. A ``post_accumulate_grad``
hook on every parameter copies its gradient into the group's flat gradient buffer
and drops autograd's copy; when a group has all its gradients, its reduction is
launched asynchronously while backward goes on with earlier layers. Groups launch in
one fixed order on every rank (a group waits for the ones before it), because
collectives must be issued in the same order on all ranks or they pair up wrongly;
groups whose parameters got no gradient are launched at the end of backward with
zeros. Each group also notes which of its parameters got a gradient on this rank
(``GroupState.used``), so that the step can leave a parameter no rank used exactly
as torch.optim leaves one whose ``.grad`` is None.

:class:`BucketedBackward` is part of :class:`zerolearn.engines.base.Engine`; it calls
the stage's ``_reduce`` and the hooks ``_after_reduce``, ``_keep_reduced``,
``_on_group_ready`` and ``_after_backward`` (the contract, in ``Engine``'s docstring).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.group import GroupState
from zerolearn.memory.ledger import category

MAX_IN_FLIGHT = 2  # reductions launched but not finished; bounds live gradient buckets


class BucketedBackward:
    """``backward`` and ``no_sync``: fill buckets from autograd hooks, reduce each when full.

    Expects what :class:`~zerolearn.engines.base.Engine` sets up: ``groups``,
    ``scaler``, ``world_size``, ``dtype``, ``device``, the stage's ``_reduce`` and
    the bookkeeping ``_next``, ``_sync``, ``_pending``, ``_no_sync_depth``,
    ``holds_reduced``, ``in_backward``, ``peak_grad_bytes``, ``temp_buffer_peak_bytes``,
    ``_grad_tally``.
    The per-parameter hooks that call :meth:`_on_grad` are registered by ``Engine``.
    """

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Backpropagate ``loss`` (a scalar, this rank's mean) into the flat gradients.

        Gradient accumulation works however it is written; scale each micro-batch's
        loss by 1 / micro-batches yourself (the fp16 loss scale is applied here):

        * ``backward`` several times before ``step`` (as with plain PyTorch): every
          backward reduces its micro-batch at once and adds the result to the
          reduced gradient of the earlier ones. Stages 2 and 3 keep their saving
          (only the 1/Nd shard is held between micro-batches), at the price of one
          reduction per micro-batch (DeepSpeed does the same).
        * ``sync=False`` (or inside :meth:`no_sync`) for all but the last micro-batch:
          gradients add up locally and the last backward reduces the sum once, like
          DDP's ``no_sync``. One reduction per step, but every stage holds the full
          gradient (2 Psi bytes) until then, so stages 2 and 3 lose their gradient
          saving while accumulating.
        """
        sync = sync and self._no_sync_depth == 0
        if self.holds_reduced:
            for g in self.groups:
                self._keep_reduced(g)
        for g in self.groups:
            g.ready = 0
        self._next, self._sync = 0, sync
        self.in_backward = True  # forwards run now are recomputations (activation checkpointing)
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        except Exception as e:
            self._abandon_backward(e)
            raise
        finally:
            self.in_backward = False
        if sync:
            for g in self.groups[self._next:]:  # groups some parameter of which got no grad
                self._ensure_grad_buffer(g)
                self._launch(g)
            self._next = len(self.groups)
            while self._pending:
                self._finish_oldest()
            self.holds_reduced = True
        self._after_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally, unreduced;
        the first backward after it reduces the sum (as ``DistributedDataParallel.no_sync``).
        Saves communication, costs memory at stages 2 and 3 (see :meth:`backward`)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def _ensure_grad_buffer(self, g: GroupState) -> None:
        if g.grad_full is None:
            with category("grads"):
                g.grad_full = torch.zeros(g.layout.padded_numel, dtype=self.dtype, device=self.device)
            self._track_grad_bytes()
            self._track_buffer(g.grad_full)

    def _on_grad(self, g: GroupState, i: int, p: nn.Parameter) -> None:
        # Called by autograd once p.grad holds this backward's full gradient of p.
        # (The hook receives the parameter, not the gradient.)
        self._ensure_grad_buffer(g)
        g.layout.view_of(g.grad_full, i).add_(p.grad)
        p.grad = None  # autograd's copy is in the bucket now; free it
        g.used[i] = True
        g.ready += 1
        if g.complete:
            self._on_group_ready(g)

    def _on_group_ready(self, g: GroupState) -> None:
        if not self._sync:
            return
        while self._next < len(self.groups) and self._may_launch(self.groups[self._next]):
            self._launch(self.groups[self._next])
            self._next += 1

    def _abandon_backward(self, error: Exception) -> None:
        """A backward failed (an error from a hook, or the model's own): finish the
        reductions in flight, which every rank issued alike, unless the process group
        itself failed; the next backward starts clean."""
        from zerolearn import guard

        if not isinstance(error, (guard.CollectiveError, guard.CollectiveMismatch)):
            while self._pending:
                self._finish_oldest()
        self._pending.clear()

    def _before_reduce(self, g: GroupState) -> None:
        """Hook: ``g``'s reduction is about to be issued (ZeRO-3 checks the ranks agree)."""

    def _may_launch(self, g: GroupState) -> bool:
        """``g``'s reduction may start during backward (else at its end): all its
        gradients are in (ZeRO-3 holds its root unit's groups to the end)."""
        return g.complete

    def _launch(self, g: GroupState) -> None:
        # Average before summing, not after: a sum of Nd loss-scaled fp16 gradients can
        # overflow where each one does not.
        if self.world_size > 1:
            g.grad_full.div_(self.world_size)
        self._before_reduce(g)
        with comm.unit(g.layout.label, "backward: reduce"):
            g.reducing = self._reduce(g)
        self._pending.append(g)
        while len(self._pending) > MAX_IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        g = self._pending.pop(0)
        g.reducing.wait()
        g.reducing = None
        self._after_reduce(g)

    # ----- measurements -------------------------------------------------------------
    def _track_buffer(self, t: torch.Tensor) -> None:
        # Every fused buffer a collective reads or writes is one group: at most bucket_mb
        # (CB, Sec 6.2), unless a single parameter is larger.
        self.temp_buffer_peak_bytes = max(self.temp_buffer_peak_bytes, t.numel() * t.element_size())

    def _track_grad_bytes(self) -> None:
        # The groups keep the tally as their gradients come and go (GroupState, GradTally).
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._grad_tally.held)
