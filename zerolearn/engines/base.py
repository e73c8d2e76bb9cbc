"""What every stage shares: the contract, the buckets, the engine's construction and forward.

The stages differ only in what a rank keeps of each bucket (Sec 5, Fig 1): the working
parameters, the gradients and the optimizer's fp32 master and moments, each all or a
shard. A stage file (``ddp.py``, ``zero1.py``, ``zero2.py``, ``zero3.py``) fills in the
four methods of the contract and reads alone. The rest of :class:`Engine` is one concern
a file: backward's state, its one beginning and end and the gradient path (``backward.py``),
the step and ``zero_grad`` (``step.py``), the state API and the wrapped module's face (``state.py``).
"""

from __future__ import annotations

import abc
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from zerolearn import comm
from zerolearn.engines import backward, optim
from zerolearn.engines import offload as offloading
from zerolearn.engines.backward import MAX_IN_FLIGHT, Backward, GradientReduction, TrainingState
from zerolearn.engines.bindings import Bindings, disown, own, refuse_unsupported
from zerolearn.engines.state import EngineStateMixin, ModuleView
from zerolearn.engines.step import OnDevice, Stepping
from zerolearn.errors import ConfigError
from zerolearn.flat import FlatLayout, bucket_caps, make_buckets
from zerolearn.memory.ledger import storage_bytes
from zerolearn.precision import LossScaler, check_param_dtypes, needs_master, parse_dtype

__all__ = ["MAX_IN_FLIGHT", "Bucket", "Engine", "TrainingState"]

# model -> weak reference to the engine that wraps it (two engines' hooks on one model clash).
_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Buffer dtypes every backend broadcasts as they are; any other travels as its bytes.
_WIRE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
                          torch.int32, torch.int64})


def _refuse_wrapped(model: nn.Module) -> None:
    """Raise a ConfigError if an engine that is not closed wraps ``model`` already."""
    earlier = _WRAPPED.get(model)
    engine = earlier() if earlier is not None else None
    if engine is not None and not engine._closed:
        raise ConfigError(
            f"this model is wrapped already by a {type(engine).__name__} that is not closed: two engines "
            "would each copy every gradient into their own buckets and step their own masters. Call "
            "engine.close() on the first one before wrapping the model again (or wrap a new model)")


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
        written: per parameter, whether ``grad_full`` holds a gradient of it yet.
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


def _cast_inputs(dtype: torch.dtype, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: every floating-point tensor in ``args`` and ``kwargs`` (nested in
    dicts, lists and tuples) in the working ``dtype``; integer and bool tensors unchanged."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return tree_map_only(torch.Tensor, cast, (args, kwargs))


class Engine(Backward, GradientReduction, Stepping, ModuleView, EngineStateMixin, abc.ABC):
    """Forward, backward, step and zero_grad over buckets; a stage implements four methods.

    **The contract** (a class lacking one fails at construction, naming it):
    ``_init_bucket(b, master32)`` keeps what the stage keeps of bucket ``b`` (``b.full``,
    ``b.shard``, ``b.master``) from its fp32 values (``padded_numel``,) and binds the
    model's parameters; ``_reduce(b) -> comm.Handle`` launches the sum over ranks of
    ``b.grad_full`` (already divided by Nd); ``_grad_for_step(b)`` is the reduced
    gradient shaped like ``b.master``; ``_publish(b)`` makes the updated master the
    working parameters. Hooks with defaults: ``num_shards`` (Nd), ``_build_buckets``,
    ``_after_reduce(b)``, ``_keep_reduced(b)``, ``_may_launch(b)``,
    ``_before_backward(roots)``, ``_after_backward()``, ``_abandon_backward(error)``.

    One step::

      forward   state FORWARD; a hook on the outputs waits for the backward
      backward  the outputs' hook: state PRE_BACKWARD, the end queued on autograd
                per parameter: its gradient added into b.grad_full; a complete bucket
                  -> grad_full /= Nd -> _reduce(b) (async), in one order on every rank
                end (POST_BACKWARD): buckets no gradient reached, wait for all
      step      global norm (clip, fp16 overflow), torch's optimizer per master, publish

    Args:
        model: an ``nn.Module`` on one device, in fp32 (it is cast to ``dtype``).
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``; ``lr``, ``weight_decay``,
            ``momentum`` (SGD) and ``betas`` (Adam) as in torch.optim.
        optimizer_kwargs: more of torch's options for that optimizer (SGD: ``nesterov``,
            ``maximize``; Adam and AdamW: ``eps``, ``amsgrad``, ``maximize``), each exact;
            SGD's ``dampening`` other than 0 is refused (:data:`zerolearn.engines.optim.OPTIONS`).
        dtype: working precision ``"fp32" | "bf16" | "fp16"`` (fp32 master for the
            2-byte ones, dynamic loss scale for fp16).
        bucket_mb: largest bucket, MiB of the working dtype (CB of Sec 6.2); None: 25
            MiB, the first one 1 MiB on a GPU as torch DDP (:func:`zerolearn.flat.bucket_caps`).
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        group: process group over the Nd data-parallel ranks (default: all ranks).
        units: ZeRO-3's gather/free units in forward order (see ``Zero3Engine``).
        mp_group: the tensor-parallel group of this rank (Nm > 1): clipping and the fp16
            overflow check see the whole gradient.
        broadcast_buffers: copy every buffer from data-parallel rank 0 at the start of
            each forward, as torch DDP does.
        offload: None, ``"cpu"`` (ZeRO-Offload, arXiv 2101.06840) or ``"disk"``
            (ZeRO-Infinity's NVMe tier, arXiv 2104.07857): :mod:`zerolearn.engines.offload`.
        offload_dir: the folder for ``"disk"``'s files (None: a temporary folder).
        dpu: ZeRO-Offload's one-step delayed parameter update. Needs offload.

    Raises:
        ConfigError: bad optimizer, optimizer_kwargs, dtype, lr, bucket size or offload option; parameters
            on several devices or of a floating dtype other than fp32 and ``dtype``; no
            trainable parameter. All before anything is allocated or communicated.
        TypeError: the class does not implement the four methods of the contract.
    """

    stage: int = -1  # DeepSpeed's numbering (0-3), recorded in checkpoints; -1: none of them
    # Every rank ends a reducing backward with the same whole reduced gradient (stage 0).
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
                 dpu: bool = False, optimizer_kwargs: dict | None = None):
        _refuse_wrapped(model)
        self.dtype = parse_dtype(dtype)
        optim.check_options(optimizer, lr, bucket_mb, max_grad_norm)
        optim.check_optimizer_kwargs(optimizer, optimizer_kwargs or {})
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
        self._offload_dir = offload_dir
        self._make_states(trainable, units)
        self._optimizer = optim.make_grouped(optimizer, [b.master for b in self.buckets], lr, weight_decay,
                                            momentum, betas, optimizer_kwargs)
        # Ranks hold different parts of the gradient exactly when masters are shards.
        self.shards_grads_for_norm = any(b.master.numel() != b.layout.padded_numel for b in self.buckets)
        self._norm_weights = (optim.replica_weights(self.buckets, torch.distributed.get_world_size(
            mp_group)) if mp_group is not None else None)
        self._init_training_state()
        self._optimizer.bind(self)  # engine.optimizer.step() is engine.step()
        _WRAPPED[model] = self._me
        own(self._me, [p for b in self.buckets for p in b.params])

    def _make_states(self, trainable: list[tuple[str, nn.Parameter]], units) -> None:
        """Buckets, the stage's share of each (``_init_bucket``), the model in the working
        dtype, and the placement of the step (offload moves the masters to the host)."""
        self.buckets: list[Bucket] = self._build_buckets(trainable, units)
        self._grad_bytes = [0]  # gradient bytes all buckets hold now, kept by Bucket.__setattr__
        masters32 = [b.layout.flatten(b.params, torch.float32, self.device) for b in self.buckets]
        if self.dtype != torch.float32:
            # fp32 tensors (the trainable parameters, and frozen ones and buffers in the model's
            # default precision) run in the working dtype; a frozen parameter or a buffer the user
            # keeps in another dtype (a float64 counter, a bf16 frozen base, int buffers) keeps it.
            self.model._apply(lambda t: t.to(self.dtype) if t.dtype == torch.float32 else t)
        for b, m in zip(self.buckets, masters32, strict=True):
            b.tally = self._grad_bytes
            self._init_bucket(b, m)
        del masters32
        if self.offload is not None:  # the masters move to the host before the optimizer sees them
            self._offload = offloading.Offload(self, self.offload, self._offload_dir, self.dpu)
        self._placement = self._offload if self._offload is not None else OnDevice()

    def _init_training_state(self) -> None:
        """The hooks (through a weak reference: a parameter's hooks live where the garbage
        collector cannot see them, so a strong one would keep every bucket alive after the
        engine is dropped; ``close()`` also removes them) and the per-step bookkeeping."""
        me = self._me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(backward._grad_arrived, me, j, i))
                       for j, b in enumerate(self.buckets) for i, p in enumerate(b.params)]
        self._hooks += [p.register_hook(functools.partial(backward._grad_coming, me))
                        for b in self.buckets for p in b.params]
        self._hooks.append(self.model.register_forward_hook(functools.partial(backward._root_forward_done, me)))
        if self.dtype != torch.float32:
            self._hooks.append(self.model.register_forward_pre_hook(
                functools.partial(_cast_inputs, self.dtype), with_kwargs=True))
        self._closed = False
        self.state = TrainingState.IDLE
        self._accumulating = False  # a parameter gradient arrived in this backward
        self._passive = False  # a backward that reaches no parameter runs
        self._partial = False  # a backward failed before its end; zero_grad not called since
        self._grad_accumulators: list | None = None  # each parameter's AccumulateGrad node, found once
        self._exposed: list[tuple[nn.Parameter, torch.Tensor]] = []  # p.grad set after backward, per parameter
        self._had_exposed = False  # p.grad was set when this backward began
        self._held: dict[int, torch.Tensor] = {}  # id(p) -> its HeldGradient, made once
        self._roots: list = []  # autograd nodes of the last forward's outputs (until a backward)
        self._bindings = Bindings(self.model, self.buckets)  # parameters replaced or cast later are named
        self._versions = self._full_versions()  # working buffers changed in place outside the engine
        self._publishing: list[comm.Handle] = []  # all_gathers of updated shards in flight
        self._used_flags: tuple[torch.Tensor, comm.Monitor | None] | None = None  # exchange in flight
        self._kept_grads: list[list[bool]] | None = None  # zero gradients zero_grad(set_to_none=False) kept
        self._last_used: list[list[bool]] | None = None  # the last step's parameters stepped
        self._next, self._sync = 0, True  # next bucket to launch; this backward reduces
        self._pending: list[Bucket] = []  # buckets whose reduction is in flight, oldest first
        self._no_sync_depth = 0
        self._engine_backward = False  # engine.backward(loss) runs (it applies fp16's loss scale)
        self.holds_reduced = False  # a reducing backward ran since the last zero_grad()
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
        """A backward adds to ``b`` while it holds an earlier one's reduced gradient."""

    def _may_launch(self, b: Bucket) -> bool:
        """``b``'s reduction may start during backward (else at its end)."""
        return b.complete

    def _before_backward(self, roots: list) -> None:
        """A backward began from the last forward's outputs (``roots``: their autograd
        nodes; empty when a backward reached a parameter without passing them)."""

    def _after_backward(self) -> None:
        """Backward is over (or failed) and every reduction finished."""

    # ----- forward ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model on this rank's slice of the batch.

        Floating-point tensors anywhere in the arguments (positional, keyword, inside dicts,
        lists and tuples) are cast to the working dtype, as FSDP2's ``cast_forward_inputs``
        does, by a pre-hook on the model, so ``model(x)`` casts too; integer ones (token ids,
        masks) pass unchanged. Buffers are first broadcast from data-parallel rank 0
        (``broadcast_buffers``), except in recomputations inside backward.
        """
        self._check_open()
        if self.state is not TrainingState.IDLE or self._passive:
            self._recover()
        self._refuse_partial()
        recompute = self.in_backward
        if not recompute:
            self._bindings.check("forward")
            self.state = TrainingState.FORWARD
        if self.broadcast_buffers and not recompute:
            with comm.unit("<model>", "forward: broadcast buffers"):
                for buf in self.model.buffers():
                    self._broadcast_buffer(buf)
        try:
            return self.model(*args, **kwargs)  # the inputs are cast by _cast_inputs, the model's pre-hook
        finally:
            if not recompute:
                self.state = TrainingState.IDLE

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

    # ----- close ------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the engine holds now rather than when it is garbage collected.

        Waits for a DPU step in flight and stops its thread, closes and removes the disk
        files, removes the hooks it put on the model, and drops the optimizer's state, the
        fp32 masters, the shards and the gradient buffers (at stages 0-2 the model keeps
        its working parameters, views of the full buffers; at stage 3 none). Idempotent;
        :meth:`forward`, :meth:`backward` and :meth:`step` raise ConfigError afterwards.
        ``with engine:`` closes on leaving the block.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        disown([p for b in self.buckets for p in b.params])
        self._placement.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._release_hooks()
        self._unexpose()
        self._held.clear()
        self._roots, self._grad_accumulators = [], None
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
