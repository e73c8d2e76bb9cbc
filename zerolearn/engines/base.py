"""What every stage shares: the contract, the buckets, and the loop skeleton.

An engine wraps a model and owns its training state. The stages differ only in what
a rank keeps of each bucket (Sec 5, Fig 1): the working parameters (all or a shard),
the gradients (all or a shard) and the optimizer's fp32 master and moments (all or a
shard). This file holds what does not differ: a :class:`Bucket`'s fields, the
skeleton of backward (gradients copied into buckets from autograd hooks, each bucket
reduced as soon as it is complete, Sec 5.2) and of the step (global norm, torch's
optimizer on the master, publish). Each stage file (``ddp.py``, ``zero1.py``,
``zero2.py``, ``zero3.py``) fills in the four methods of the contract and reads alone.

Instrumentation stays out of the stage files: the skeleton names each collective for
debug mode and the profiler (``comm.unit``), counts gradient bytes and fused buffer
sizes, and tags allocations for the memory ledger around the stage's calls.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from zerolearn import comm, guard
from zerolearn.engines import offload as offloading
from zerolearn.engines import optim
from zerolearn.engines.bindings import Bindings, HeldGradient, refuse_sparse_grad, refuse_unsupported
from zerolearn.engines.state import EngineStateMixin
from zerolearn.engines.units import tensors_in
from zerolearn.errors import ConfigError
from zerolearn.flat import FlatLayout, bucket_caps, make_buckets
from zerolearn.memory.ledger import category, retag, storage_bytes
from zerolearn.precision import LossScaler, check_param_dtypes, needs_master, parse_dtype

MAX_IN_FLIGHT = 2  # reductions launched but not finished; bounds the gradient buckets alive
# Buffer dtypes every backend broadcasts as they are; any other (int16, bool, uint16, complex)
# travels as its bytes, which is the same copy.
_WIRE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
                          torch.int32, torch.int64})


def _grad_arrived(engine_ref: weakref.ref, j: int, i: int, p: nn.Parameter) -> None:
    """Post-accumulate-grad hook of parameter ``i`` of bucket ``j``: ``Engine._on_grad``."""
    engine = engine_ref()
    if engine is not None:
        engine._on_grad(engine.buckets[j], i, p)


def _grad_coming(engine_ref: weakref.ref, grad: torch.Tensor) -> None:
    """Hook on a parameter, run before autograd adds its gradient to ``p.grad``: the
    engine's backward has begun (``Engine._ensure_backward``), so ``p.grad`` is empty."""
    engine = engine_ref()
    if engine is not None and not engine._bwd_open:
        engine._ensure_backward()


def _output_grad_arrived(engine_ref: weakref.ref, grad: torch.Tensor) -> None:
    """Hook on a forward's output: a backward reached it (``loss.backward()`` called by the
    user, or ``engine.backward``): ``Engine._ensure_backward``."""
    engine = engine_ref()
    if engine is not None:
        engine._ensure_backward()


def _backward_over(engine_ref: weakref.ref) -> None:
    """Queued on autograd's engine by a backward the engine did not start itself: runs
    when that backward is over (``Engine._end_backward``)."""
    engine = engine_ref()
    if engine is not None and engine._bwd_open:
        engine._end_backward()


@dataclass(eq=False)
class Bucket:
    """One bucket's tensors on this rank (``None``: not held now); the stage fills them.

    =========  ===============  ===============  ================  ===============
    stage      ``full``         ``shard``        ``grad_full``     ``grad_shard``
    =========  ===============  ===============  ================  ===============
    0 (DP)     kept             -                kept              -
    1 (P_os)   kept             -                kept              while accumulating
    2 (+g)     kept             -                until reduced     kept
    3 (+p)     gathered in use  kept             until reduced     kept
    =========  ===============  ===============  ================  ===============

    Attributes:
        layout: names, offsets and this rank's shard range (:class:`FlatLayout`).
        params: the model's parameters in buffer order, views of ``full``.
        full: working parameters, (``padded_numel``,) in the working dtype.
        shard: working-parameter shard, (``shard_numel``,), ZeRO-3 only.
        master: what the optimizer steps, fp32: (``padded_numel``,) at stage 0,
            (``shard_numel``,) at stages 1-3; in fp32 it may share ``full``'s storage.
        grad_full: this backward's gradient of the whole bucket, before reduction.
        grad_shard: the reduced (averaged) gradient of this rank's shard.
        reduced: a reduction's output that is added to the kept gradient afterwards.
        reducing: the reduction in flight, or None.
        ready: parameters whose gradient arrived in this backward.
        written: per parameter, whether ``grad_full`` holds a gradient of it yet (the buffer
            is allocated uninitialised: a first gradient is copied in, later ones added).
        used: per parameter, whether it got a gradient on this rank since ``zero_grad``.
        skipped: per parameter, steps it sat out because no rank used it.
    """

    layout: FlatLayout
    params: list[nn.Parameter]
    full: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    master: nn.Parameter | None = None
    grad_full: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    reduced: torch.Tensor | None = None
    reducing: comm.Handle | None = field(default=None, repr=False)
    ready: int = 0
    used: list[bool] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    tally: list[int] | None = field(default=None, repr=False)  # [gradient bytes held by all buckets]
    written: list[bool] = field(default_factory=list, repr=False)  # per parameter: in grad_full yet
    grad_views: list[torch.Tensor] | None = field(default=None, repr=False)  # grad_full per parameter, made once

    def __post_init__(self) -> None:
        self.used = [False] * len(self.params)
        self.skipped = [0] * len(self.params)

    def __setattr__(self, name: str, value) -> None:
        # Keeps the engine's count of gradient bytes held (peak_grad_bytes) in O(1), and
        # drops grad_full's per-parameter views with it (they would keep its memory alive).
        if name not in ("grad_full", "grad_shard"):
            return object.__setattr__(self, name, value)
        if name == "grad_full":
            object.__setattr__(self, "grad_views", None)
        tally = self.__dict__.get("tally")
        if tally is None:
            return object.__setattr__(self, name, value)
        before = storage_bytes([self.grad_full, self.grad_shard])
        object.__setattr__(self, name, value)
        tally[0] += storage_bytes([self.grad_full, self.grad_shard]) - before

    @property
    def complete(self) -> bool:
        """Every parameter's gradient of this backward is in ``grad_full``."""
        return self.ready == len(self.params)

    def views_of_grad(self) -> list[torch.Tensor]:
        """Each parameter's view of ``grad_full`` (allocated), shaped as the parameter: cut
        once per ``grad_full`` (:meth:`FlatLayout.views`) and shared by every hook."""
        if self.grad_views is None:
            self.grad_views = self.layout.views(self.grad_full)
        return self.grad_views

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s view of ``grad_full`` (:meth:`views_of_grad`)."""
        return self.views_of_grad()[i]


class Engine(EngineStateMixin, abc.ABC):
    """Forward, backward, step and zero_grad over buckets; a stage implements four methods.

    **The contract** (a class lacking one fails at construction, naming it):

    * ``_init_bucket(b, master32)``: keep what the stage keeps of bucket ``b``
      (``b.full``, ``b.shard``, ``b.master``) from ``master32``, its fp32 values
      (``padded_numel``,), and bind the model's parameters (``b.layout.bind``).
    * ``_reduce(b) -> comm.Handle``: launch the sum over ranks of ``b.grad_full``
      (already divided by Nd), asynchronously.
    * ``_grad_for_step(b) -> Tensor``: the reduced gradient, shaped like ``b.master``.
    * ``_publish(b)``: make ``b.master``'s updated values the working parameters.

    Hooks with defaults: ``num_shards`` (Nd), ``_build_buckets``, ``_after_reduce(b)``,
    ``_keep_reduced(b)``, ``_on_bucket_ready(b)``, ``_may_launch(b)``,
    ``_before_backward(loss)``, ``_after_backward()``, ``_abandon_backward(error)``.

    One step, in call order::

      backward  autograd hook per parameter: add p.grad into b.grad_full
                bucket complete -> _on_bucket_ready(b) -> launch ready buckets in one order:
                  grad_full /= Nd -> _reduce(b) (async); > MAX_IN_FLIGHT: wait the oldest
                  -> _after_reduce(b)
                end: launch buckets no gradient reached, wait for all -> _after_backward()
      step      _grad_for_step(b) for every b -> global norm: clip, fp16 overflow
                per b: torch's optimizer steps b.master, then _publish(b)

    Args:
        model: an ``nn.Module`` on one device, in fp32 (it is cast to ``dtype``).
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``; ``lr``, ``weight_decay``,
            ``momentum`` (SGD) and ``betas`` (Adam) as in torch.optim.
        dtype: working precision ``"fp32" | "bf16" | "fp16"`` (fp32 master for the
            2-byte ones, dynamic loss scale for fp16).
        bucket_mb: largest bucket, MiB of the working dtype (CB of Sec 6.2); None (the
            default): 25 MiB buckets, the first one 1 MiB on a GPU as torch DDP makes
            it (:func:`zerolearn.flat.bucket_caps`).
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        group: process group over the Nd data-parallel ranks (default: all ranks).
        units: ZeRO-3's gather/free units in forward order (see ``Zero3Engine``).
        mp_group: the model-parallel (tensor-parallel) group of this rank (Nm > 1), so that
            clipping and the fp16 overflow check see the whole gradient (parameters
            marked ``tensor_parallel = True`` differ per rank, the others are replicas).
        broadcast_buffers: copy every buffer from data-parallel rank 0 at the start of
            each forward, as torch DDP does.
        offload: None; ``"cpu"`` (ZeRO-Offload, Ren et al., ATC'21, arXiv 2101.06840): the
            fp32 master, the moments and the fp32 gradient shard in host memory, torch's
            optimizer steps there; ``"disk"`` (ZeRO-Infinity, SC'21, arXiv 2104.07857):
            as "cpu", each bucket's optimizer states in a file between its steps
            (:mod:`zerolearn.engines.offload`). Stages 1-3.
        offload_dir: the folder for ``"disk"``'s files (created if missing; None: a
            temporary folder, removed by :meth:`close` or garbage collection).
        dpu: ZeRO-Offload's one-step delayed parameter update: the host step of step t
            runs on a thread during step t + 1's forward and backward, which use
            parameters one update stale; the first step is synchronous. Needs offload.

    Parameters unused in a step follow torch: one no rank used since ``zero_grad`` is
    not updated (no momentum, Adam moment or step count, weight decay); one some ranks
    used gets the average with zeros from the others (DDP, ``find_unused_parameters``).

    Raises:
        ConfigError: bad optimizer, dtype, lr, bucket size or offload option (stage 0
            or an unknown offload, dpu without offload, an offload_dir that cannot be
            written: :func:`zerolearn.engines.offload.check_options`); parameters on several
            devices or of a floating dtype other than fp32 and ``dtype``; no trainable
            parameter. All before anything is allocated or communicated.
        TypeError: the class does not implement the four methods of the contract.
    """

    stage: int = -1  # DeepSpeed's numbering (0-3), recorded in checkpoints; -1: none of them
    # Every rank ends a reducing backward with the same whole reduced gradient (stage 0): it
    # tells which parameters some rank used, without exchanging flags (_exchange_used_flags).
    replicated_grads: bool = False

    def __new__(cls, *args, **kwargs):
        from zerolearn.engines.zeropp_units import refuse_options  # ZeRO++ options: stage 3 only
        refuse_options(cls.stage, kwargs)
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise TypeError(f"{cls.__name__} does not implement {', '.join(missing)}: an engine must implement "
                            "_init_bucket, _reduce, _grad_for_step and _publish (zerolearn.engines.base.Engine)")
        return super().__new__(cls)

    def __init__(self, model: nn.Module, *, optimizer: str = "adam", lr: float = 1e-3,
                 weight_decay: float = 0.0, momentum: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), dtype: str = "fp32",
                 bucket_mb: float | None = None, max_grad_norm: float | None = None,
                 group=None, units: list[nn.Module] | None = None, mp_group=None,
                 broadcast_buffers: bool = True, offload: str | None = None, offload_dir: str | None = None,
                 dpu: bool = False):
        self.dtype = parse_dtype(dtype)
        optim.check_options(optimizer, lr, bucket_mb, max_grad_norm)
        offloading.check_options(self.stage, offload, offload_dir, dpu)
        self._offload: offloading.Offload | None = None
        self.device = optim.model_device(model)
        self.model, self.pg, self.mp_group = model, group, mp_group
        self.rank = torch.distributed.get_rank(group)
        self.world_size = torch.distributed.get_world_size(group)
        self.buffer_src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        self.broadcast_buffers = broadcast_buffers and self.world_size > 1
        self.optimizer_name, self.max_grad_norm = optimizer, max_grad_norm
        self.first_bucket_bytes, self.bucket_bytes = bucket_caps(bucket_mb, self.device.type)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16, device=self.device)
        self.mixed, self.offload, self.dpu = needs_master(self.dtype), offload, dpu
        # An fp32 master of its own; else (fp32, no offload) a view of the working parameters.
        self.separate_master = self.mixed or offload is not None
        check_param_dtypes(model, self.dtype)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("the model has no trainable parameters (all requires_grad=False)")
        refuse_unsupported(model, trainable)
        self.psi = sum(p.numel() for _, p in trainable)

        self.buckets: list[Bucket] = self._build_buckets(trainable, units)
        self._grad_bytes = [0]  # gradient bytes all buckets hold now, kept by Bucket.__setattr__
        masters32 = [b.layout.flatten(b.params, torch.float32, self.device) for b in self.buckets]
        if self.dtype != torch.float32:
            # fp32 tensors (the trainable parameters, and frozen ones and buffers in the model's
            # default precision) run in the working dtype; a frozen parameter or a buffer the user
            # keeps in another dtype (a float64 counter, a bf16 frozen base, int buffers) keeps it.
            model._apply(lambda t: t.to(self.dtype) if t.dtype == torch.float32 else t)
        for b, m in zip(self.buckets, masters32):
            b.tally = self._grad_bytes
            self._init_bucket(b, m)
        del masters32
        if offload is not None:  # the masters move to the host before the optimizer sees them
            self._offload = offloading.Offload(self, offload, offload_dir, dpu)
        self._optimizer = optim.make_grouped(optimizer, [b.master for b in self.buckets], lr, weight_decay,
                                            momentum, betas)
        # Ranks hold different parts of the gradient exactly when masters are shards.
        self.shards_grads_for_norm = any(b.master.numel() != b.layout.padded_numel for b in self.buckets)
        self._norm_weights = (optim.replica_weights(self.buckets, torch.distributed.get_world_size(
            mp_group)) if mp_group is not None else None)
        # The hooks reach the engine through a weak reference: a parameter's hooks live where
        # the garbage collector cannot see them, so a strong one would keep every bucket alive
        # after the engine is dropped (close() also removes them).
        me = weakref.ref(self)
        self._me = me
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_grad_arrived, me, j, i))
                       for j, b in enumerate(self.buckets) for i, p in enumerate(b.params)]
        self._hooks += [p.register_hook(functools.partial(_grad_coming, me)) for b in self.buckets for p in b.params]
        self._optimizer.bind(self)  # engine.optimizer.step() is engine.step()
        self._closed = False
        self._bwd_open = False  # a backward is running (begun by engine.backward or by a hook)
        self._exposed: list[tuple[nn.Parameter, torch.Tensor]] = []  # p.grad set after backward, per parameter
        self._held: dict[int, torch.Tensor] = {}  # id(p) -> its HeldGradient, made once
        self._roots: list = []  # autograd nodes of the last forward's outputs (until a backward)
        self._bindings = Bindings(model, self.buckets)  # parameters replaced or cast later are named
        self._versions = self._full_versions()  # working buffers changed in place outside the engine
        self._publishing: list[comm.Handle] = []  # all_gathers of updated shards in flight
        self._used_flags: tuple[torch.Tensor, comm.Monitor | None] | None = None  # exchange in flight
        self._next, self._sync = 0, True  # next bucket to launch; this backward reduces
        self._pending: list[Bucket] = []  # buckets whose reduction is in flight, oldest first
        self._no_sync_depth = 0
        self.holds_reduced = False  # a reducing backward ran since the last zero_grad()
        self.in_backward = False  # forwards run now are recomputations (activation checkpointing)
        self.peak_grad_bytes = 0  # most gradient bytes held at once, measured
        self.temp_buffer_peak_bytes = 0  # largest fused communication buffer, bytes (Sec 6.2)

    # ----- the contract -------------------------------------------------------------
    @abc.abstractmethod
    def _init_bucket(self, b: Bucket, master32: torch.Tensor) -> None:
        """Set ``b.full`` / ``b.shard`` / ``b.master`` from ``master32`` (fp32, (padded_numel,))."""

    @abc.abstractmethod
    def _reduce(self, b: Bucket) -> comm.Handle:
        """Launch the (async) sum over ranks of ``b.grad_full``; return its handle."""

    @abc.abstractmethod
    def _grad_for_step(self, b: Bucket) -> torch.Tensor:
        """The reduced gradient, shaped and placed like ``b.master``."""

    @abc.abstractmethod
    def _publish(self, b: Bucket) -> None:
        """Copy or all_gather ``b.master``'s updated values into the working parameters."""

    # ----- hooks with defaults --------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Equal shards each bucket is padded to: Nd (1 for a stage that shards nothing)."""
        return self.world_size

    def _build_buckets(self, trainable: list[tuple[str, nn.Parameter]], units) -> list[Bucket]:
        # Reverse registration order approximates the order gradients arrive in.
        return self._buckets_of(trainable[::-1])

    def _buckets_of(self, named: list[tuple[str, nn.Parameter]], small_first: bool = True) -> list[Bucket]:
        """``named`` cut into buckets of at most ``bucket_mb`` (:func:`flat.make_buckets`);
        ``small_first``: the first one capped at the policy's first-bucket size."""
        by_name = dict(named)
        return [Bucket(layout, [by_name[n] for n in layout.names]) for layout in
                make_buckets(named, self.bucket_bytes, self.dtype.itemsize, self.num_shards,
                             self.rank % self.num_shards, self.first_bucket_bytes if small_first else None)]

    def _after_reduce(self, b: Bucket) -> None:
        """``b``'s reduction finished (default: it wrote its result in place)."""

    def _keep_reduced(self, b: Bucket) -> None:
        """A backward starts while ``b`` holds an earlier one's reduced gradient."""

    def _may_launch(self, b: Bucket) -> bool:
        """``b``'s reduction may start during backward (else at its end)."""
        return b.complete

    def _before_backward(self, loss) -> None:
        """Backward is about to run from ``loss`` (a tensor), or, when the user called
        ``loss.backward()``, from the last forward's outputs (a list of their autograd nodes)."""

    def _after_backward(self) -> None:
        """Backward is over and every reduction finished."""

    # ----- forward ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model on this rank's slice of the batch.

        Floating-point tensor arguments are cast to the working dtype; integer ones (token
        ids) pass unchanged. Buffers are first broadcast from data-parallel rank 0
        (``broadcast_buffers``), except in recomputations inside backward.
        """
        self._check_open()
        if self._bwd_open and torch._C._current_graph_task_id() == -1:
            self._drop_backward()  # a backward begun by a hook failed before its end: start clean
        if not self.in_backward:
            self._bindings.check("forward")
        if self.broadcast_buffers and not self.in_backward:
            with comm.unit("<model>", "forward: broadcast buffers"):
                for buf in self.model.buffers():
                    self._broadcast_buffer(buf)
        cast = [a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        out = self.model(*cast, **kwargs)
        if torch.is_grad_enabled() and not self.in_backward:
            # loss.backward() instead of engine.backward(loss): the first hook a backward reaches
            # starts the engine's backward and queues its end (Engine._ensure_backward).
            outputs = [t for t in tensors_in(out) if t.requires_grad]
            for t in outputs:
                t.register_hook(functools.partial(_output_grad_arrived, self._me))
            self._roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
        return out

    def _broadcast_buffer(self, buf: torch.Tensor) -> None:
        """Buffer ``buf`` from data-parallel rank 0, in its own dtype: one the backends cannot
        broadcast (int16, bool, unsigned, complex) travels as its bytes."""
        if buf.dtype in _WIRE_DTYPES:
            comm.broadcast(buf, src=self.buffer_src, group=self.pg, tag="buffers")
            return
        wire = buf if buf.is_contiguous() else buf.contiguous()
        comm.broadcast(wire.reshape(-1).view(torch.uint8), src=self.buffer_src, group=self.pg, tag="buffers")
        if wire is not buf:
            buf.copy_(wire)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ----- backward: buckets filled by autograd hooks ----------------------------------
    def backward(self, loss: torch.Tensor, sync: bool = True, **kwargs) -> None:
        """Backpropagate ``loss`` (a scalar, this rank's mean) into the buckets and reduce them.

        Gradient accumulation: scale each micro-batch's loss by 1 / micro-batches. Several
        ``backward`` calls before ``step`` each reduce at once and add to the earlier
        reduced gradient (stages 2-3 keep only their shard meanwhile); ``sync=False`` or
        :meth:`no_sync` adds gradients locally and the next reducing backward reduces the
        sum once, like DDP's ``no_sync``, holding the full gradient (2 Psi bytes) until then.

        ``loss.backward()`` does the same as ``engine.backward(loss)`` (the engine's hooks
        start and finish its work), except with fp16's loss scale, which only this method
        applies. After backward, at stage 0 each ``p.grad`` is the reduced gradient, a view
        of its bucket (DDP's ``gradient_as_bucket_view``): clip or scale it in place.
        At stages 1-3, and with fp16 or tensor parallelism, a rank holds no whole reduced
        gradient of a parameter: ``p.grad`` is a :class:`~zerolearn.engines.bindings.HeldGradient`
        that refuses to be read (use ``max_grad_norm=`` or :meth:`clip_grad_norm_`).

        Args:
            kwargs: torch's ``Tensor.backward`` arguments (``retain_graph``, ``gradient``,
                ``inputs``), passed on.

        Raises:
            ConfigError: ``create_graph=True`` (the buckets hold gradients without their graph).
        """
        self._check_open()
        if kwargs.get("create_graph"):
            raise ConfigError("engine.backward(create_graph=True): the engine copies gradients into flat buckets "
                              "and reduces them, without their graph, so a gradient of a gradient would be "
                              "silently wrong; compute higher-order gradients with torch.autograd.grad on the "
                              "model outside the engine")
        self._begin_backward(loss, sync and self._no_sync_depth == 0)
        try:
            self._scaled(loss).backward(**kwargs)
        except Exception as e:
            self._drop_backward(e)
            raise
        self._end_backward()

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times fp16's loss scale, in ``loss``'s dtype; the scale is a device tensor,
        so nothing is read (``loss`` itself without fp16)."""
        if not self.scaler.enabled:
            return loss
        return (loss * self.scaler.scale_tensor.to(torch.float32)).to(loss.dtype)

    def _begin_backward(self, loss: torch.Tensor | None, sync: bool) -> None:
        """What runs before autograd's backward: earlier reduced gradients set aside, counts
        reset, ``p.grad`` given back to autograd, the stage's :meth:`_before_backward`."""
        if self.holds_reduced:  # once: a later backward must not set aside this one's local sums
            for b in self.buckets:
                self._keep_reduced(b)
            self.holds_reduced = False
        for b in self.buckets:
            b.ready = 0
        self._next, self._sync = 0, sync
        self._unexpose()
        roots, self._roots = self._roots, []  # loss.backward() (loss None): the last forward's outputs
        self._before_backward(loss if loss is not None else roots)
        self._bwd_open = True
        self.in_backward = True

    def _ensure_backward(self) -> None:
        """A backward reached one of the engine's hooks: if ``engine.backward`` did not start
        it (the user called ``loss.backward()``), start the engine's work now and queue its
        end on autograd's engine, to run once the whole backward is over.

        Raises:
            ConfigError: fp16 (the loss scale is applied by ``engine.backward`` alone).
        """
        if self._bwd_open:
            return
        if self.scaler.enabled:
            raise ConfigError("loss.backward() in an fp16 run: the engine multiplies the loss by its dynamic loss "
                              "scale, which only engine.backward(loss) can do; call engine.backward(loss)")
        self._begin_backward(None, self._no_sync_depth == 0)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_over, self._me))

    def _end_backward(self) -> None:
        """What runs after autograd's backward: buckets no gradient reached are launched, the
        used-parameter flags exchanged, every reduction waited for, ``p.grad`` set."""
        self.in_backward = False
        try:
            if self._sync:
                for b in self.buckets[self._next:]:  # buckets some parameter of which got no gradient
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
            self._after_backward()
        except Exception as e:
            self._drop_backward(e)
            raise
        self._bwd_open = False
        self._expose()

    def _drop_backward(self, error: Exception | None = None) -> None:
        """A backward failed: :meth:`_abandon_backward`, and no backward is open any more."""
        self.in_backward = False
        self._bwd_open = False
        self._abandon_backward(error if error is not None else RuntimeError("backward abandoned"))

    # ----- gradients a user reads between backward and step --------------------------------
    def _expose(self) -> None:
        """Give every trainable parameter a ``.grad`` that is true or refuses to be read."""
        views = self.replicated_grads and not self.scaler.enabled and self.mp_group is None
        exposed = []
        for b in self.buckets:
            if views and b.grad_full is not None:
                self._zero_unwritten(b)
                for p, view in zip(b.params, b.views_of_grad()):
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

    def _unexpose(self) -> None:
        """``p.grad`` back to None (autograd accumulates into it in the next backward)."""
        for p, _ in self._exposed:
            p.grad = None
        self._exposed = []

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

    def _on_grad(self, b: Bucket, i: int, p: nn.Parameter) -> None:
        # Autograd calls this once p.grad holds this backward's whole gradient of p.
        self._ensure_backward()  # loss.backward() of a forward not run through the engine
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

    def _on_bucket_ready(self, b: Bucket) -> None:
        # Collectives pair up by order: launch buckets in one fixed order on every rank.
        if not self._sync:
            return
        while self._next < len(self.buckets) and self._may_launch(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
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
        if self._offload is not None:
            self._offload.take_grad(self, b)  # the reduced shard to the host's fp32 buffer

    def _ensure_grad_full(self, b: Bucket) -> None:
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

    def _zero_unwritten(self, b: Bucket) -> None:
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

    # ----- step ------------------------------------------------------------------------
    def step(self) -> bool | optim.Stepped:
        """Update parameters from the reduced gradients.

        The same as ``engine.optimizer.step()`` (:meth:`optim.GroupedOptimizer.step`), which
        it calls, so torch's LR schedulers and optimizer step hooks see the step. A
        hyperparameter changed in ``engine.optimizer.param_groups[0]`` applies from this step.

        Returns:
            True when no overflow check ran (fp32 or bf16 without ``max_grad_norm``);
            else an :class:`optim.Stepped`, whose ``bool()`` is False when an overflow
            (fp16, or a non-finite norm under clipping) skipped the step. The flag stays on
            the device until that ``bool()`` reads it: read it after the step, once.
        """
        self._check_open()
        self._optimizer.step()
        return self._optimizer.stepped

    @torch.no_grad()
    def _step(self) -> bool | optim.Stepped:
        """The step itself (see :meth:`step`).

        Clipping and the overflow check share one number, the global gradient norm
        (``clip_grad_norm_``'s formula, summed over ranks when they hold different
        parts). Then bucket by bucket: torch's optimizer steps the master, and the update
        is published while the next bucket steps, so in mixed precision one bucket's fp32
        gradient exists at a time (the paper's (2 + 2 + K) Psi holds none). On CUDA in fp32, where
        the gradients are the reduced buffers themselves, one fused step updates every master
        (:meth:`optim.GroupedOptimizer.step_all`, :func:`optim.multi_tensor_kind`), then each
        bucket is published; the CPU steps bucket by bucket, as above. With offload the
        norm and the update read the host's fp32 gradients and torch's optimizer steps the
        host master (:class:`zerolearn.engines.offload.Offload`).

        Nothing here waits for the host to read a device value, as torch's ``GradScaler``
        steps: the norm, the clipping factor and the overflow flag stay 0-dim device tensors;
        an overflowed step is computed and then masked away (each master and its optimizer
        state keep their values, ``torch.where`` on the flag; the step count goes back one),
        and the loss scale is updated on the device. Two cases read the flag on the host, as
        their work is decided there: offload (the host steps) and a step in which some
        parameter sits out (no rank used it: its elements are stepped apart).
        """
        self._check_open()
        self._bindings.check("step")
        self._check_exposed()
        self._absorb_changes()
        for b in self.buckets:  # a gradient kept without a reduction (stage 0-1, no_sync) is read whole
            self._zero_unwritten(b)
        off = self._offload
        if off is not None:
            off.land(self)  # DPU: the update in flight finishes and is published
        grads = off.grads_for_step(self) if off is not None else [self._grad_for_step(b) for b in self.buckets]
        if self._used_flags is None:  # no reducing backward since zero_grad
            self._exchange_used_flags()
        used = self._used_anywhere()
        self._optimizer.push_hyperparameters()  # an LR scheduler's lr, a hand-set one
        coef, found_inf = self._unscale_and_clip(grads)
        if found_inf is not None:
            self.scaler.update(found_inf)
            if off is not None or not all(all(u) for u in used):
                if bool(found_inf):  # the host decides this step's work: read the flag
                    return False
                coef, found_inf = float(coef), None
        if off is not None:
            off.step(self, used, coef)  # the host's step, publish (under DPU: on a thread)
            return True
        parts = [optim.parts_to_step(self._optimizer, i, b, used[i]) for i, b in enumerate(self.buckets)]
        # One multi-tensor step over every master (CUDA) where the gradients already are fp32
        # buffers; in mixed precision each bucket's fp32 gradient is made, used and dropped in
        # turn, so the (2 + 2 + K) Psi of the paper holds: those step bucket by bucket.
        at_once = self._optimizer.multi is not None and not self.mixed and all(p is None for p in parts)
        for i, (b, grad) in enumerate(zip(self.buckets, grads)):
            b.master.grad = grad.float() if grad.dtype != torch.float32 else grad
            if not (isinstance(coef, float) and coef == 1.0):
                b.master.grad.mul_(coef)
            if not at_once:
                self._step_one(i, b, parts[i], found_inf)
        if at_once:
            self._optimizer.step_all(found_inf)
            for i, b in enumerate(self.buckets):
                self._step_one(i, b, None, None, stepped=True)
        self._finish_publish()
        return True if found_inf is None else optim.Stepped(found_inf)

    def _step_one(self, i: int, b: Bucket, parts, found_inf: torch.Tensor | None, stepped: bool = False) -> None:
        """Bucket ``b``'s master stepped (unless ``stepped``: :meth:`optim.GroupedOptimizer.step_all`
        did), its gradient dropped, its state tagged for the ledger, the update published."""
        if not stepped:
            self._optimizer.step_bucket(i, parts, found_inf)
        b.master.grad = None
        retag(optim.optimizer_state(self._optimizer, b.master), "optimizer_states")
        with comm.unit(b.layout.label, "step: publish"):
            self._publish(b)

    def _exchange_used_flags(self, reduced: bool = False) -> None:
        """Start finding out which parameters any rank used since ``zero_grad``: one
        all_reduce (max) of a byte per parameter, outside the ledger, as DDP does.

        ``reduced``: called, at a stage with ``replicated_grads`` (stage 0), once a reducing
        backward's reductions all finished: every rank then holds the same whole reduced
        gradient, which answers first. A rank that did not use a parameter adds zeros, so a
        parameter whose reduced gradient has a nonzero element was used by some rank. Only
        if some parameter's reduced gradient is all zeros (unused everywhere, or used with a
        zero gradient) do the ranks exchange flags. Every rank reads the same numbers, so
        every rank takes the same path. That read is the host's, so only the CPU answers
        from the gradient (:attr:`flags_from_grads`); on an accelerator the flags travel in
        every step (asynchronously, beside the last reductions), and nothing is read.
        """
        if self._used_flags is not None and self._used_flags[1] is not None:
            self._used_flags[1].wait()  # an earlier backward's, superseded
        flags = torch.tensor([flag for b in self.buckets for flag in b.used], dtype=torch.uint8, device=self.device)
        pending = None
        if self.world_size > 1 and torch.distributed.get_backend(self.pg) != "fake":  # fake: rank 0 alone
            if reduced and self.flags_from_grads and self._every_grad_nonzero():
                flags.fill_(1)  # every parameter has a nonzero reduced gradient: some rank used it
            else:
                with comm.unit("<model>", "backward: which parameters were used"):
                    pending = comm.monitor_max(flags, group=self.pg, async_op=True)
        self._used_flags = (flags, pending)

    def _every_grad_nonzero(self) -> bool:
        """Whether every parameter's part of ``grad_full`` holds a nonzero element (NaN and
        inf count as nonzero). Each parameter's first element is read in one gather per
        bucket; only a parameter whose first element is zero is read whole."""
        for b, firsts in zip(self.buckets, self._first_elements):
            if b.grad_full is None or firsts is None:
                return False
            head = b.grad_full[firsts]
            if bool(head.all()):
                continue
            for i in (head == 0).nonzero().flatten().tolist():
                if not bool(b.layout.view_of(b.grad_full, i).any()):
                    return False
        return True

    @functools.cached_property
    def _first_elements(self) -> list[torch.Tensor | None]:
        """Per bucket, the offset of each parameter in ``grad_full`` (int64, one per parameter);
        None for a bucket with an empty parameter, which has no element to tell."""
        return [torch.tensor(b.layout.offsets, dtype=torch.int64, device=self.device)
                if all(math.prod(shape) > 0 for shape in b.layout.shapes) else None for b in self.buckets]

    @functools.cached_property
    def flags_from_grads(self) -> bool:
        """Stage 0 (``replicated_grads``) learns which parameters were used from the reduced
        gradient, a host read of it, only where the host holds it (the CPU); on an
        accelerator that read would make the host wait for the device, and the flags are
        exchanged instead (:meth:`_exchange_used_flags`)."""
        return self.device.type == "cpu"

    def _used_anywhere(self) -> list[list[bool]]:
        """Per bucket and parameter: did any rank use it since ``zero_grad``
        (:meth:`_exchange_used_flags`, waited for here)? A parameter this rank used was used
        (the exchange is a max): when this rank used every one, the exchanged flags are
        not read. Only a rank that left a parameter unused reads them (a host read)."""
        flags, pending = self._used_flags
        if pending is not None:
            pending.wait()
        self._used_flags = None
        if all(all(b.used) for b in self.buckets):
            return [[True] * len(b.params) for b in self.buckets]
        mine = flags.bool().tolist()
        out, k = [], 0
        for b in self.buckets:
            out.append(mine[k:k + len(b.params)])
            k += len(b.params)
        return out

    def _global_sum_of_squares(self, grads: list[torch.Tensor], when: str) -> torch.Tensor:
        """Sum of squares of the whole reduced gradient (still times the loss scale), fp32
        scalar on the device: this rank's part, summed over the ranks holding other parts."""
        sq = optim.sum_of_squares(grads, self._norm_weights, self.device).to(self.device)
        with comm.unit("<model>", f"{when}: gradient norm"):
            if self.shards_grads_for_norm and self.world_size > 1:
                comm.all_reduce(sq, group=self.pg)
            if self.mp_group is not None:  # tensor-parallel ranks hold other slices
                comm.all_reduce(sq, group=self.mp_group, tag="tp")
        return sq

    def _unscale_and_clip(self, grads: list[torch.Tensor]) -> tuple[float | torch.Tensor, torch.Tensor | None]:
        """(factor to multiply the gradients by, whether the norm overflowed on any rank).

        Without clipping or fp16: ``(1.0, None)``, nothing computed. Else the factor is a
        float64 0-dim tensor on the device, ``1 / scale * min(1, max_grad_norm / (norm +
        1e-6))`` (the clipping factor 1 on overflow), and the flag a bool 0-dim tensor there,
        ``not isfinite(norm)``, the same on every rank (the norm is summed over them): no
        host read.
        """
        if self.max_grad_norm is None and not self.scaler.enabled:
            return 1.0, None
        scale = self.scaler.scale_tensor
        sq = self._global_sum_of_squares(grads, "step")
        norm = sq.sqrt().double() / scale
        found_inf = ~torch.isfinite(norm)
        coef = 1.0 / scale
        if self.max_grad_norm is not None:
            clip = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            coef = coef * torch.where(found_inf, torch.ones_like(clip), clip)
        return coef, found_inf

    def _publish_all(self) -> None:
        """:meth:`_publish` every bucket, then wait for the all_gathers it launched."""
        for b in self.buckets:
            with comm.unit(b.layout.label, "step: publish"), self._publishing_shard(b):
                self._publish(b)
        self._finish_publish()

    def _finish_publish(self) -> None:
        for handle in self._publishing:
            handle.wait()
        self._publishing.clear()
        self._versions = self._full_versions()

    # ----- parameters read or changed between steps ---------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True):
        """A block in which every trainable parameter holds its full working values, to read
        or change between steps (log a norm, clamp weights, ``model.load_state_dict``), as
        FSDP's ``summon_full_params``.

        At ZeRO-3 the parameters are gathered on entry (an all_gather per bucket: call on
        every rank) and freed on exit; at stages 0-2 every rank holds them already. With
        ``writeback``, elements changed inside the block become the fp32 master's values
        (and at ZeRO-3 the kept shard's) on exit: make the same change on every rank, as
        each rank keeps its own shard of the result. Under DPU the update in flight is
        published first.

        Args:
            writeback: copy changed values into the masters (and shards) on exit.

        Raises:
            ConfigError: (on entry) a parameter replaced or cast since wrapping
                (:class:`zerolearn.engines.bindings.Bindings`).
        """
        self._bindings.check("summon_full_params block")
        self.finish_dpu()
        self._summon()
        try:
            yield
        finally:
            try:
                if writeback:
                    with torch.no_grad(), self.offload_resident():
                        for b in self.buckets:
                            self._write_back(b)
            finally:
                self._unsummon()
                self._versions = self._full_versions()

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """``model.load_state_dict(state_dict, strict)`` inside :meth:`summon_full_params`:
        the loaded values become the working parameters, the masters and (ZeRO-3) the
        shards. A collective at ZeRO-3: call on every rank with the same state dict. The
        optimizer's state is kept (load a checkpoint with :mod:`zerolearn.checkpoint` to
        restore it too). Returns torch's ``(missing_keys, unexpected_keys)``."""
        with self.summon_full_params():
            return self.model.load_state_dict(state_dict, strict=strict)

    def _summon(self) -> None:
        """Make every parameter hold its full values (stages 0-2: they do)."""

    def _unsummon(self) -> None:
        """Undo :meth:`_summon`."""

    def _write_back(self, b: Bucket) -> None:
        """Elements of ``b``'s working parameters that differ from the master (rounded to the
        working dtype) were changed outside the engine: they become the master's values."""
        work = b.full if b.master.numel() == b.layout.padded_numel else b.layout.shard_of(b.full)
        if b.shard is not None:  # ZeRO-3 keeps a working shard (in fp32 without offload, the master)
            b.shard.copy_(work)
            work = b.shard
        master = b.master.data
        if work.untyped_storage()._cdata == master.untyped_storage()._cdata:
            return  # the master is the working buffer (fp32 stage 0) or the shard itself
        work = work.to(master.device)
        changed = work != master.to(work.dtype)
        if bool(changed.any()):
            master[changed] = work[changed].to(master.dtype)

    def _full_versions(self) -> list[int] | None:
        """Version counters of the working buffers (stages 0-2 without offload; else None)."""
        if self._offload is not None or self.stage not in (0, 1, 2):
            return None
        return [b.full._version for b in self.buckets]

    def _absorb_changes(self) -> None:
        """Working parameters changed in place since the last publish (``p.clamp_()`` or
        ``model.load_state_dict`` under no_grad, outside :meth:`summon_full_params`) keep
        their change, as they would in torch: the changed elements go to the master."""
        if self._versions is None:
            return
        for b, version in zip(self.buckets, self._versions):
            if b.full._version != version:
                with torch.no_grad():
                    self._write_back(b)
        self._versions = self._full_versions()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the engine's reduced gradient, between
        backward and step: the global 2-norm over every trainable parameter (summed over
        the ranks that hold different parts: a collective, call it on every rank), and the
        gradient scaled in place by ``min(1, max_norm / (norm + 1e-6))``, as torch does.

        Use it where ``clip_grad_norm_(model.parameters(), ...)`` would read ``p.grad``: at
        stages 1-3 no rank holds a whole reduced gradient of a parameter. ``max_grad_norm=``
        of the engine does the same inside every step.

        Args:
            max_norm: the largest norm kept (a finite number > 0).
            norm_type: 2.0 only.

        Returns:
            the norm before clipping, an fp32 scalar tensor (unscaled by fp16's loss scale;
            inf or NaN when the gradient overflowed, and then nothing is scaled: the step skips).

        Raises:
            ConfigError: ``norm_type`` other than 2, or ``max_norm`` not a finite number > 0.
        """
        self._check_open()
        if float(norm_type) != 2.0:
            raise ConfigError(f"engine.clip_grad_norm_(norm_type={norm_type!r}): only 2.0 (the 2-norm, as "
                              "max_grad_norm= uses) is supported")
        if not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) or max_norm <= 0:
            raise ConfigError(f"engine.clip_grad_norm_(max_norm={max_norm!r}): a finite number > 0 is needed")
        for b in self.buckets:
            self._zero_unwritten(b)
        off = self._offload
        if off is not None:
            off.land(self, starts_step=False)
        grads = off.grads_for_step(self) if off is not None else [self._grad_for_step(b) for b in self.buckets]
        grads = [g if g is not None else torch.zeros(0, device=self.device) for g in grads]
        sq = self._global_sum_of_squares(grads, "clip_grad_norm_")
        norm = sq.sqrt() / self.scaler.scale_tensor.to(sq.dtype)
        # Decided on the device (no host read): a non-finite norm scales nothing (factor 1).
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (buffers are allocated again in the next backward).

        Args:
            set_to_none: as torch's: True, every ``p.grad`` becomes None; False, at stage 0
                (where ``p.grad`` views the gradient buckets) the buckets are kept and
                zeroed, so ``p.grad`` reads zeros; at stages 1-3, which hold no whole
                gradient of a parameter, ``p.grad`` becomes None either way.
        """
        if self._used_flags is not None:
            self._used_anywhere()  # an exchange nobody stepped with: finish it
        keep = not set_to_none and self._exposed and not isinstance(self._exposed[0][1], HeldGradient)
        if not keep:
            self._unexpose()
        for b in self.buckets:
            if keep and b.grad_full is not None:
                b.grad_full.zero_()
            else:
                b.grad_full = None
            b.grad_shard = None
            b.used = [False] * len(b.params)
        if self._offload is not None:
            self._offload.zero_grad()
        self.holds_reduced = False

    # ----- the engine as the module it wraps ---------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model (torch DDP's and FSDP's name for it)."""
        return self.model

    @property
    def training(self) -> bool:
        """The model's ``training`` flag."""
        return self.model.training

    def train(self, mode: bool = True):
        """``model.train(mode)`` (dropout on, BatchNorm updates its statistics); returns the engine."""
        self.model.train(mode)
        return self

    def eval(self):
        """``model.eval()``; returns the engine."""
        return self.train(False)

    def named_parameters(self, *args, **kwargs):
        """The model's ``named_parameters``, with the model's names. At ZeRO-3 they hold
        their values only inside :meth:`summon_full_params`."""
        return self.model.named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        """The model's ``parameters`` (see :meth:`named_parameters`)."""
        return self.model.parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        """The model's ``named_buffers``."""
        return self.model.named_buffers(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        """The model's ``buffers``."""
        return self.model.buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs) -> dict:
        """The model's ``state_dict``, with the model's names and the working dtype. At
        stages 0-2 the model's own (tensors sharing the parameters' memory, as torch's); at
        ZeRO-3 copies of the full values, gathered inside :meth:`summon_full_params` (a
        collective: call on every rank). :meth:`full_state_dict` gives the fp32 masters."""
        if self.stage != 3:
            return self.model.state_dict(*args, **kwargs)
        with self.summon_full_params(writeback=False):
            return {k: v.detach().clone() if torch.is_tensor(v) else v
                    for k, v in self.model.state_dict(*args, **kwargs).items()}

    # ----- offload (zerolearn.engines.offload) ------------------------------------------------
    def _shard_in(self, b: Bucket) -> None:
        """Stage 3, ``offload="disk"``: ``b.shard`` read from its file before a gather reads it."""
        if self._offload is not None:
            self._offload.shard_in(b)

    def _shard_out(self, b: Bucket) -> None:
        """Stage 3, ``offload="disk"``: the gather that read ``b.shard`` is over, its memory released."""
        if self._offload is not None:
            self._offload.shard_out(b)

    def _publishing_shard(self, b: Bucket):
        """Around ``_publish(b)``: stage 3 on disk writes the updated shard to its file."""
        return self._offload.publishing(b) if self._offload is not None else contextlib.nullcontext()

    @property
    def optimizer(self) -> optim.GroupedOptimizer:
        """torch's optimizer over the masters (:class:`optim.GroupedOptimizer`). Under DPU a
        read waits for the host step in flight, so whoever reads its state (a checkpoint)
        sees the finished update, never one half done."""
        if self._offload is not None:
            self._offload.wait()
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: optim.GroupedOptimizer) -> None:
        self._optimizer = value

    def finish_dpu(self) -> None:
        """Wait for the DPU host step in flight and publish its update, so the working
        parameters equal the masters (a collective at stages 1-2: call on every rank).
        A no-op without DPU or with nothing in flight."""
        if self._offload is not None and self._offload.delay is not None:
            self._offload.land(self, starts_step=False)

    def offload_stats(self) -> dict[str, float]:
        """Disk I/O of the last step (``offload="disk"``; zeros otherwise): ``bytes_read``,
        ``bytes_written`` (bytes), ``io_seconds`` (s), ``read_bandwidth``,
        ``write_bandwidth`` (bytes/s; 0.0 without I/O). Under DPU it waits for the step
        in flight and also counts the masters read to publish the previous update."""
        if self._offload is None:
            return {"bytes_read": 0, "bytes_written": 0, "io_seconds": 0.0, "read_bandwidth": 0.0,
                    "write_bandwidth": 0.0}
        return self._offload.stats()

    def close(self) -> None:
        """Release what the engine holds now rather than when it is garbage collected.

        Waits for a DPU step in flight and stops its thread, closes and removes the disk
        files, removes the hooks it put on the model's parameters and modules, and drops
        the optimizer's state, the fp32 masters, the shards and the gradient buffers (at
        stages 0-2 the model keeps its working parameters, which are views of the full
        buffers; at stage 3 it keeps none). Idempotent; :meth:`forward`,
        :meth:`backward` and :meth:`step` raise ConfigError afterwards. ``with engine:``
        closes on leaving the block.

        Without it the engine is freed as soon as the last reference to it goes (its hooks
        reach it through a weak reference), the model included; ``close()`` is for a
        caller that keeps the model, or the engine object, and wants the memory back.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._offload is not None:
            self._offload.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._release_hooks()
        self._unexpose()
        self._held.clear()
        self._roots = []
        self._optimizer = None  # its state: the moments of every master
        self._pending, self._publishing, self._used_flags = [], [], None
        for b in self.buckets:
            b.master = b.shard = b.grad_full = b.grad_shard = b.reduced = b.reducing = None

    def _release_hooks(self) -> None:
        """Remove hooks a stage put on the model's modules (``_module_hooks``: ZeRO-3's gather and free)."""
        for handle in getattr(self, "_module_hooks", ()):
            handle.remove()
        self._module_hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise ConfigError(f"this {type(self).__name__} was closed (engine.close()): it holds no optimizer "
                              "state or masters any more; wrap the model in a new engine to train again")
