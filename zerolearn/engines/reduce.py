"""Backward's half of the engine: gradients into buckets, buckets reduced as they fill.

A parameter's post-accumulate-grad hook (:func:`_grad_arrived`) copies its gradient into
its view of the bucket's flat buffer and drops autograd's copy; a complete bucket is
reduced at once (Sec 5.2), in one order on every rank, at most :data:`MAX_IN_FLIGHT` in
flight. Between backward and step, ``p.grad`` is the reduced gradient where a rank holds
it whole (stage 0), else a :class:`~zerolearn.engines.bindings.HeldGradient`.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from zerolearn import comm, guard
from zerolearn.engines.bindings import HeldGradient, refuse_sparse_grad
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import category

MAX_IN_FLIGHT = 2  # reductions launched but not finished; bounds the gradient buckets alive


def _grad_arrived(engine_ref: weakref.ref, j: int, i: int, p: nn.Parameter) -> None:
    """Post-accumulate-grad hook of parameter ``i`` of bucket ``j``: ``_on_grad``."""
    engine = engine_ref()
    if engine is not None:
        engine._on_grad(engine.buckets[j], i, p)


def _grad_coming(engine_ref: weakref.ref, grad: torch.Tensor) -> None:
    """Hook on a parameter, run before autograd adds its gradient to ``p.grad``: the
    buckets are made ready to take this backward's gradients (``_start_accumulating``)."""
    engine = engine_ref()
    if engine is not None and not engine._accumulating:
        engine._start_accumulating()


class GradientReduction:
    """The engine's gradient path (mixed into :class:`zerolearn.engines.base.Engine`)."""

    def _start_accumulating(self) -> None:
        """This backward's first parameter gradient is coming: a backward no hook on the
        outputs began begins here; an earlier reduced gradient is set aside (``_keep_reduced``)."""
        self._ensure_backward()
        self._accumulating = True
        if self.holds_reduced:  # once: a later backward must not set aside this one's local sums
            for b in self.buckets:
                self._keep_reduced(b)
            self.holds_reduced = False

    def _on_grad(self, b, i: int, p: nn.Parameter) -> None:
        # Autograd calls this once p.grad holds this backward's whole gradient of p.
        if not self._accumulating:
            self._start_accumulating()
        self._ensure_grad_full(b)
        grad = p.grad
        if grad.layout != torch.strided:
            refuse_sparse_grad(b.layout.names[i])
        view = b.grad_view(i)
        view.add_(grad) if b.written[i] else view.copy_(grad)
        b.written[i] = True
        p.grad = None  # autograd's copy is in the bucket now
        b.used[i] = True
        b.ready += 1
        if b.complete:
            self._on_bucket_ready(b)

    def _on_bucket_ready(self, b) -> None:
        # Collectives pair up by order: launch buckets in one fixed order on every rank.
        if not self._sync:
            return
        while self._next < len(self.buckets) and self._may_launch(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b) -> None:
        self._ensure_grad_full(b)  # a bucket whose gradients all arrive as zeros (zero3's uneven backward)
        self._zero_unwritten(b)  # parameters no gradient reached in this buffer hold zeros
        if self.world_size > 1:
            b.grad_full.div_(self.world_size)  # before the sum: Nd fp16 gradients could overflow it
        with comm.unit(b.layout.label, "backward: reduce"):
            b.reducing = self._reduce(b)
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._grad_bytes[0])
        self._pending.append(b)
        while len(self._pending) > MAX_IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        b = self._pending.pop(0)
        b.reducing.wait()
        b.reducing = None
        self._after_reduce(b)
        self._placement.take_grad(self, b)  # offload: the reduced shard to the host's fp32 buffer

    def _reduce_the_rest(self) -> None:
        """Backward is over: launch the buckets some parameter of which got no gradient,
        start the used-parameter exchange, wait for every reduction."""
        for b in self.buckets[self._next:]:
            self._ensure_grad_full(b)
            self._launch(b)
        self._next = len(self.buckets)
        if not (self.replicated_grads and self.flags_from_grads):
            self._exchange_used_flags()  # travels while the last reductions finish
        while self._pending:
            self._finish_oldest()
        if self.replicated_grads and self.flags_from_grads:
            self._exchange_used_flags(reduced=True)  # read from the reduced gradient if it can
        self.holds_reduced = True

    def _ensure_grad_full(self, b) -> None:
        # Uninitialised, as torch DDP's bucket after zero_grad: filling Psi zeros every step
        # costs a pass over the memory. Each parameter's first gradient is copied in; the
        # padding is zeroed now, parameters with no gradient just before the buffer is read.
        if b.grad_full is None:
            with category("grads"):
                b.grad_full = torch.empty(b.layout.padded_numel, dtype=self.dtype, device=self.device)
            b.grad_full[b.layout.numel:].zero_()
            b.written = [False] * len(b.params)
            self.peak_grad_bytes = max(self.peak_grad_bytes, self._grad_bytes[0])
            self.temp_buffer_peak_bytes = max(self.temp_buffer_peak_bytes, b.grad_full.nbytes)

    def _zero_unwritten(self, b) -> None:
        """Zero the elements of ``b.grad_full`` no gradient was written to (unused parameters)."""
        if b.grad_full is not None and not all(b.written):
            for i, done in enumerate(b.written):
                if not done:
                    b.grad_view(i).zero_()
            b.written = [True] * len(b.params)

    def _new_grad(self, numel: int) -> torch.Tensor:
        """An uninitialised gradient buffer of ``numel`` elements, counted as gradients."""
        with category("grads"):
            return torch.empty(numel, dtype=self.dtype, device=self.device)

    def _abandon_backward(self, error: Exception) -> None:
        """A backward failed: finish the reductions in flight (every rank issued them)
        unless the process group itself failed; the next backward starts clean."""
        if not isinstance(error, (guard.CollectiveError, guard.CollectiveMismatch)):
            while self._pending:
                self._finish_oldest()
        self._pending.clear()

    # ----- gradients a user reads between backward and step --------------------------------
    def _expose(self) -> None:
        """Give every trainable parameter a ``.grad`` that is true or refuses to be read."""
        views = self.replicated_grads and not self.scaler.enabled and self.mp_group is None
        exposed = []
        for b in self.buckets:
            if views and b.grad_full is not None:
                self._zero_unwritten(b)
                for p, view in zip(b.params, b.views_of_grad(), strict=True):
                    if p.dtype == view.dtype:  # else its data was cast: Bindings names it at the step
                        p.grad = view
                        exposed.append((p, view))
            elif not views:
                for p in b.params:
                    held = self._held.get(id(p))
                    if held is None:
                        held = self._held[id(p)] = HeldGradient.make(p, self.stage)
                    p.grad = held
                    exposed.append((p, held))
        self._exposed = exposed
        self._placement.wait()  # DPU: its thread sets the host masters' .grad while it steps them
        for b in self.buckets:  # the optimizer's params (clip over engine.optimizer.param_groups)
            whole = (views and b.grad_full is not None
                     and b.grad_full.dtype == b.master.dtype and b.grad_full.numel() == b.master.numel())
            b.master.grad = b.grad_full if whole else HeldGradient.make(b.master, -1)

    def _unexpose(self) -> None:
        """``p.grad`` back to None (autograd accumulates into it in the next backward); a
        master's ``.grad`` that :meth:`_expose` set, too (never one a DPU step in flight set)."""
        for p, _ in self._exposed:
            p.grad = None
        self._exposed = []
        for b in self.buckets:
            if b.master is not None and (isinstance(b.master.grad, HeldGradient) or b.master.grad is b.grad_full):
                b.master.grad = None

    def _check_exposed(self) -> None:
        """Before a step: every ``p.grad`` set after backward is still the one set.

        Raises:
            ConfigError: naming a parameter whose ``.grad`` was replaced.
        """
        names = None
        for p, grad in self._exposed:
            if p.grad is not grad:
                names = names or {id(q): n for n, q in self.model.named_parameters()}
                raise ConfigError(
                    f"parameter {names.get(id(p), '?')}: its .grad was replaced or set to None between backward "
                    "and step; the engine steps the gradient in its buckets, so the new one would be ignored. "
                    "Change gradients in place (p.grad.mul_(c), at stage 0), clip with max_grad_norm= or "
                    "engine.clip_grad_norm_(max_norm), and drop gradients with engine.zero_grad()")

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside this block accumulate locally; the next one reduces the sum."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
