"""Where a step is, the one beginning and one end of every backward (torch FSDP2's manner), and
the gradients that arrive in it: into buckets, reduced as they fill.

An engine is in one :class:`TrainingState` at a time. A backward begins in
:meth:`Backward._ensure_backward`, run by a hook on the wrapped model's outputs (put there
by the model's forward hook, for ``engine(x)`` and ``model(x)`` alike), and ends in
:meth:`Backward._end_backward`, a callback on autograd's graph task, so a reentrant
checkpoint's inner backward ends nothing. A backward that reaches no parameter (an
input's gradient) neither begins nor reduces.

Parameter hooks only accumulate (:class:`GradientReduction`): a parameter's
post-accumulate-grad hook (:func:`_grad_arrived`) copies its gradient into its view of the
bucket's flat buffer and drops autograd's copy; a complete bucket is reduced at once
(Sec 5.2), in one order on every rank, at most :data:`MAX_IN_FLIGHT` in flight. Between
backward and step, ``p.grad`` is the reduced gradient where a rank holds it whole (stage 0),
else a :class:`~zerolearn.engines.bindings.HeldGradient`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from zerolearn import comm, guard
from zerolearn.engines.bindings import HeldGradient, refuse_sparse_grad
from zerolearn.engines.units import tensors_in
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import category


class TrainingState(enum.Enum):
    """Where an engine is in a step (torch FSDP2's ``TrainingState``)."""

    IDLE = "idle"  # between steps, or between forward and backward
    FORWARD = "forward"  # the model's forward runs
    PRE_BACKWARD = "pre_backward"  # a backward reached the model's outputs: gradients arrive
    POST_BACKWARD = "post_backward"  # the backward's end: the last reductions finish


def _root_forward_done(engine_ref: weakref.ref, module, args, output) -> None:
    """Forward hook on the wrapped model (``engine(x)`` and ``model(x)`` alike): a hook on
    each output that needs a gradient begins the engine's backward when one reaches it."""
    engine = engine_ref()
    if engine is None or engine.in_backward or not torch.is_grad_enabled():
        return  # a recomputation inside backward (activation checkpointing), or no graph
    outputs = [t for t in tensors_in(output) if t.requires_grad]
    for t in outputs:
        t.register_hook(functools.partial(_root_grad_arrived, engine_ref))
    engine._roots = [t.grad_fn for t in outputs if t.grad_fn is not None]


def _root_grad_arrived(engine_ref: weakref.ref, grad: torch.Tensor) -> None:
    engine = engine_ref()
    if engine is not None:
        engine._ensure_backward()


def _backward_over(engine_ref: weakref.ref) -> None:
    """Queued on autograd's graph task by :meth:`Engine._ensure_backward`: runs once that
    backward is over (``Engine._end_backward``)."""
    engine = engine_ref()
    if engine is not None and engine.state is TrainingState.PRE_BACKWARD:
        engine._end_backward()


def _passive_backward_over(engine_ref: weakref.ref) -> None:
    """Queued by a backward that reaches no parameter (an input's gradient): what it
    gathered is freed (ZeRO-3's ``_after_backward``); the buckets were never touched."""
    engine = engine_ref()
    if engine is not None:
        engine._passive = False
        if engine.state is TrainingState.IDLE:
            engine._after_backward()


def _reaches_a_parameter(engine) -> bool:
    """Inside a backward: will autograd accumulate a gradient into any trainable parameter?
    (``torch.autograd.grad`` of an input, or ``backward(inputs=[x])``, will not.) Each
    parameter's gradient accumulator is looked up once and kept, as torch DDP keeps them."""
    if engine._grad_accumulators is None:
        with torch._C.DisableTorchFunctionSubclass():  # a freed ZeRO-3 parameter refuses ops otherwise
            engine._grad_accumulators = [get_gradient_edge(p).node for b in engine.buckets for p in b.params]
    return any(torch._C._will_engine_execute_node(node) for node in engine._grad_accumulators)


class Backward:
    """The engine's backward (mixed into :class:`zerolearn.engines.base.Engine`)."""

    @property
    def in_backward(self) -> bool:
        """A backward is running: forwards run now are recomputations (activation checkpointing)."""
        return self.state is TrainingState.PRE_BACKWARD

    def backward(self, loss: torch.Tensor, sync: bool = True, **kwargs) -> None:
        """Backpropagate ``loss`` (a scalar, this rank's mean) into the buckets and reduce them.

        Gradient accumulation: scale each micro-batch's loss by 1 / micro-batches. Several
        ``backward`` calls before ``step`` each reduce at once and add to the earlier
        reduced gradient; ``sync=False`` or :meth:`no_sync` adds gradients locally and the
        next reducing backward reduces the sum once, like DDP's ``no_sync``.

        ``loss.backward()`` does the same, except with fp16's loss scale, which only this
        method applies. After backward, at stage 0 each ``p.grad`` is the reduced gradient,
        a view of its bucket (DDP's ``gradient_as_bucket_view``); at stages 1-3, and with
        fp16 or tensor parallelism, ``p.grad`` is a
        :class:`~zerolearn.engines.bindings.HeldGradient` that refuses to be read (use
        ``max_grad_norm=`` or :meth:`clip_grad_norm_`). A backward that reaches no
        parameter (``torch.autograd.grad`` of an input) leaves the buckets alone.

        Args:
            kwargs: torch's ``Tensor.backward`` arguments (``retain_graph``, ``gradient``,
                ``inputs``), passed on.

        Raises:
            ConfigError: ``create_graph=True`` (the buckets hold gradients without their graph).
        """
        self._check_open()
        if kwargs.get("create_graph"):
            raise ConfigError(_CREATE_GRAPH)
        self._engine_backward, self._sync = True, sync and self._no_sync_depth == 0
        try:
            self._scaled(loss).backward(**kwargs)
        except Exception as e:
            self._passive = False
            if self.state is not TrainingState.IDLE:
                self._drop_backward(e)
            raise
        finally:
            self._engine_backward = False

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times fp16's loss scale, in ``loss``'s dtype (a device tensor: nothing read)."""
        if not self.scaler.enabled:
            return loss
        return (loss * self.scaler.scale_tensor.to(torch.float32)).to(loss.dtype)

    def _ensure_backward(self) -> None:
        """The one place a backward begins (the hook on the model's outputs, or the first
        parameter's hook): state PRE_BACKWARD, ``p.grad`` handed back to autograd, the stage's
        :meth:`_before_backward`, the end (:meth:`_end_backward`) queued on the graph task.

        Raises:
            ConfigError: ``create_graph=True``; fp16 through ``loss.backward()``; at ZeRO-3, a
                gradient of an input with ``create_graph=True``.
        """
        if self.state is TrainingState.PRE_BACKWARD or self._passive:
            return
        if not _reaches_a_parameter(self):  # an input's gradient: the engine has nothing to do
            if torch.is_grad_enabled() and self.stage == 3:
                raise ConfigError(_INPUT_GRAPH_AT_ZERO3)
            self._passive = True
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_passive_backward_over, self._me))
            return
        if torch.is_grad_enabled():  # autograd runs a backward with create_graph=True in grad mode
            raise ConfigError(_CREATE_GRAPH)
        if self.scaler.enabled and not self._engine_backward:
            raise ConfigError("loss.backward() in an fp16 run: the engine multiplies the loss by its dynamic loss "
                              "scale, which only engine.backward(loss) can do; call engine.backward(loss)")
        if not self._engine_backward:
            self._sync = self._no_sync_depth == 0
        self._absorb_dropped_grads()
        self.state = TrainingState.PRE_BACKWARD
        self._accumulating, self._next = False, 0
        for b in self.buckets:
            b.ready = 0
        self._had_exposed = bool(self._exposed)
        self._unexpose()
        roots, self._roots = self._roots, []
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_over, self._me))
        self._before_backward(roots)

    def _absorb_dropped_grads(self) -> None:
        """``model.zero_grad()`` set every ``p.grad`` the last backward gave to None: as in
        torch, this backward starts from no gradient. A ConfigError if only some were."""
        dropped = [p for p, _ in self._exposed if p.grad is None]
        if not dropped:
            return
        if len(dropped) < len(self._exposed):
            names = {id(q): n for n, q in self.model.named_parameters()}
            raise ConfigError(f"p.grad of {names.get(id(dropped[0]), '?')} (and {len(dropped) - 1} more, not all) "
                              "was set to None after the last backward: the engine keeps every parameter's "
                              "gradient in its buckets and drops them all at once; call engine.zero_grad()")
        self.zero_grad()

    def _end_backward(self) -> None:
        """The one place a backward ends: a backward that accumulated a gradient reduces
        what is left and waits for every reduction; ``p.grad`` set; state IDLE."""
        self.state = TrainingState.POST_BACKWARD
        try:
            if self._accumulating and self._sync:
                self._reduce_the_rest()
            self._after_backward()
        except Exception as e:
            self._drop_backward(e)
            raise
        self.state = TrainingState.IDLE
        if self._accumulating or self._had_exposed:
            self._expose()

    def _recover(self) -> None:
        """Outside every backward, a state left by one that failed before its end (an error
        in a hook or in the user's code): the engine starts clean."""
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside a running backward
        self._passive = False
        if self.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            self._drop_backward()
        self.state = TrainingState.IDLE

    def _drop_backward(self, error: Exception | None = None) -> None:
        """A backward failed: :meth:`_abandon_backward`; no backward is open any more, and
        the buckets hold part of one until :meth:`zero_grad` (:meth:`_refuse_partial`)."""
        self.state = TrainingState.IDLE
        self._partial = True
        self._abandon_backward(error if error is not None else RuntimeError("backward abandoned"))

    def _refuse_partial(self) -> None:
        """Before a forward or a step: a ConfigError while a failed backward's gradients are
        held (until ``zero_grad``), as torch DDP refuses the next iteration."""
        if self._partial:
            raise ConfigError(_PARTIAL)


_PARTIAL = ("the last backward raised before it ended (an error in a hook, in the model's backward or in a "
            "collective): the buckets hold the gradients of part of it, some reduced and some not. Call "
            "engine.zero_grad() before the next forward or step (torch's DDP refuses the next iteration too), "
            "then train on")

_CREATE_GRAPH = ("backward with create_graph=True: the engine copies gradients into flat buckets and reduces "
                 "them, without their graph, so a gradient of a gradient would be silently wrong; compute "
                 "higher-order gradients with torch.autograd.grad(..., create_graph=True) on the model's "
                 "inputs (the engine leaves a backward that reaches no parameter alone), and the training "
                 "loss's backward without create_graph")

_INPUT_GRAPH_AT_ZERO3 = (
    "torch.autograd.grad(..., create_graph=True) of an input at ZeRO-3 (a gradient penalty): the gradient's graph "
    "keeps the units' gathered parameters, which ZeRO-3 frees when this backward ends, so the penalty's own "
    "backward would read freed memory; train such a loss at stage 0, 1 or 2, where it is exact as in torch")


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
        """A backward failed: finish the reductions in flight (every rank issued them), then
        :meth:`_after_backward`, unless the process group itself failed; the next backward starts clean."""
        if not isinstance(error, (guard.CollectiveError, guard.CollectiveMismatch)):
            while self._pending:
                self._finish_oldest()
            self._after_backward()
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
