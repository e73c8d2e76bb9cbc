"""The engine every stage is: its contract, construction, forward and the step.

An engine wraps a model and owns its training state. Stages differ only in what a
rank keeps of each flat group (Sec 5): the working parameters (full or a shard),
the gradients (full or a shard) and the optimizer's fp32 master and moments (full or
a shard). :class:`Engine` runs the step; a stage says what to keep by implementing
four methods (the contract, in :class:`Engine`'s docstring).

``Engine`` is put together from three files, one idea each: this one (the contract,
forward, the optimizer step), :mod:`~zerolearn.engines.buckets` (backward: gradient
buckets reduced from autograd hooks, Sec 5.2) and :mod:`~zerolearn.engines.state`
(what a rank holds: bytes, full parameters, loading shards). Frozen parameters
(``requires_grad=False``) are not flattened or sharded at all.
"""

from __future__ import annotations

import abc
import functools

import torch
from torch import nn

from zerolearn import comm
from zerolearn.dist import ConfigError
from zerolearn.engines import optim
from zerolearn.engines.buckets import MAX_IN_FLIGHT, BucketedBackward
from zerolearn.engines.group import GradTally, GroupState
from zerolearn.engines.state import EngineStateMixin
from zerolearn.flat import FlatLayout, buckets
from zerolearn.memory.ledger import retag
from zerolearn.precision import LossScaler, check_param_dtypes, needs_master, parse_dtype

OPTIMIZERS = optim.OPTIMIZERS
__all__ = ["MAX_IN_FLIGHT", "OPTIMIZERS", "Engine"]


class Engine(BucketedBackward, EngineStateMixin, abc.ABC):
    """Shared interface of the four stages: forward, backward, step, zero_grad, ledgers.

    **The contract.** A stage subclasses ``Engine`` and implements four methods; a
    class that lacks one cannot be constructed (``TypeError`` naming the class and
    the missing methods, raised before anything is allocated):

    * ``_init_group(g, master32)``: lay out group ``g``'s working parameters
      (``g.full``, ``g.shard``; bind the model's parameters to them) and its fp32
      master ``g.master``, from ``master32``, the group's fp32 values (``padded_numel``,).
    * ``_reduce(g) -> comm.Handle``: launch the reduction (a sum; the gradient was
      already divided by Nd) of ``g.grad_full``, asynchronously: all_reduce,
      reduce_scatter, ...
    * ``_grad_for_step(g) -> Tensor``: the reduced gradient matching ``g.master``
      element for element, in the working dtype.
    * ``_publish(g)``: after the update, make ``g.master``'s new values the working
      parameters (a cast, or an all_gather of the updated shards into ``_publishing``).

    Hooks with defaults, for what some stages need: ``num_shards`` (Nd: the groups
    are padded to this many equal shards), ``_build_groups`` (bucket the parameters;
    ZeRO-3 keeps groups inside units), ``_after_reduce(g)`` (finish a reduction:
    keep what this rank needs, free the rest; default nothing), ``_keep_reduced(g)``
    (a backward starts while ``g`` holds an earlier one's reduced gradient),
    ``_on_group_ready(g)`` (overrides must call ``super()``), ``_after_backward()``.

    One step, in call order ([R] required, [h] hook with a default)::

      build     num_shards [h] -> _build_groups [h] -> per group g: _init_group(g, master32) [R]
      ----------------------------------------------------------------------------------
      forward   engine(x): broadcast buffers from rank 0 -> model(x)
                (ZeRO-3: a unit's hooks all_gather it before its forward, free it after)
      backward  [g holds the last backward's reduced gradient: _keep_reduced(g) [h]]
                autograd hook per parameter: add p.grad into g.grad_full (g's bucket)
                  |
                  |  bucket ready: every parameter of g has its gradient
                  v
                _on_group_ready(g) [h] -> launch the ready groups, in fixed order:
                  _launch(g): g.grad_full /= Nd -> _reduce(g) [R]
                  |             (async all_reduce or reduce_scatter: a sum over ranks)
                  v  more than MAX_IN_FLIGHT in flight: wait for the oldest, then
                _after_reduce(g) [h]
                end: launch groups no gradient reached, wait for all, _after_backward() [h]
      step      _grad_for_step(g) [R] for every g
                -> global norm (one all_reduce of partial sums): clip; fp16 overflow skips
                -> per g: optimizer.step() on g.master (the shard of the update),
                   then _publish(g) [R] (all_gather of the updated shard, async)
                -> wait for the publishes
      zero_grad drop g.grad_full, g.grad_shard

    Args:
        model: an ``nn.Module`` on one device, in fp32 (it is cast to ``dtype``).
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``; ``lr``, ``weight_decay``,
            ``momentum`` (SGD) and ``betas`` (Adam) as in torch.optim.
        dtype: working precision ``"fp32" | "bf16" | "fp16"`` (fp32 master for the
            2-byte ones, dynamic loss scale for fp16).
        bucket_mb: largest gradient bucket / flat group, MiB of working dtype.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        group: process group over the Nd data-parallel ranks (default: all ranks).
        units: ZeRO-3's gather/free units in forward order (default ``model.units()``
            if it exists, else the model's direct children, a ModuleList's items in
            its place; parameters shared by two units, or by a unit and a module
            outside every unit, such as tied embeddings, go to the root unit, gathered
            for the whole forward and backward). A unit's parameters may be read only
            inside its own forward (elsewhere: ConfigError naming the parameter): the
            next unit in the list is prefetched while the current one runs, and a unit
            is freed when its forward returns. Every rank must run the same units in
            the same order (else ConfigError naming the ranks and their units).
        model_parallel_group: the tensor-parallel group of this rank (Nm > 1), so that
            clipping and the fp16 overflow check see the whole gradient: parameters
            marked ``tensor_parallel = True`` are slices that differ per rank, the
            others are replicas counted once.
        broadcast_buffers: copy every buffer (BatchNorm's running statistics) from
            data-parallel rank 0 at the start of each forward, as torch DDP does, so
            ranks never drift apart; False leaves them per rank (SyncBatchNorm is
            the way to make the statistics themselves global).

    Parameters unused in a step follow torch: one that no rank used since the last
    ``zero_grad`` is not updated at all (no momentum, no Adam moment or step count, no
    weight decay), as torch.optim skips a parameter whose ``.grad`` is None; one that
    some ranks used gets the average over all ranks with zeros from the others, as DDP
    with ``find_unused_parameters=True``. Ranks learn which parameters were used
    anywhere from one small exchange of flags per step (outside the ledger, like
    monitoring).

    Raises:
        ConfigError: bad optimizer, dtype, lr or bucket size; parameters on several
            devices; parameters of a floating dtype other than fp32 and ``dtype``
            (float64, or bf16 under fp32: they would be cast silently), named with
            their dtypes. All raised before anything is allocated or communicated.
        TypeError: the class does not implement the four required methods.
    """

    stage: int = -1  # DeepSpeed's numbering (0-3), recorded in checkpoints; -1: none of them

    def __new__(cls, *args, **kwargs):
        # abc would refuse too; this says which contract the class broke.
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise TypeError(f"{cls.__name__} does not implement {', '.join(missing)}: an engine must implement "
                            "_init_group, _reduce, _grad_for_step and _publish (zerolearn.engines.base.Engine)")
        return super().__new__(cls)

    def __init__(self, model: nn.Module, *, optimizer: str = "adam", lr: float = 1e-3,
                 weight_decay: float = 0.0, momentum: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), dtype: str = "fp32",
                 bucket_mb: float = 4.0, max_grad_norm: float | None = None,
                 group=None, units: list[nn.Module] | None = None, model_parallel_group=None,
                 broadcast_buffers: bool = True):
        self.dtype = parse_dtype(dtype)
        optim.check_options(optimizer, lr, bucket_mb, max_grad_norm)
        self.device = optim.model_device(model)
        self.model, self.pg, self.mp_group = model, group, model_parallel_group
        self.rank = torch.distributed.get_rank(group)
        self.world_size = torch.distributed.get_world_size(group)
        self.buffer_src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        self.broadcast_buffers = broadcast_buffers and self.world_size > 1
        self.optimizer_name, self.max_grad_norm = optimizer, max_grad_norm
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16)
        self.mixed = needs_master(self.dtype)

        check_param_dtypes(model, self.dtype)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("the model has no trainable parameters (all requires_grad=False)")
        self.psi = sum(p.numel() for _, p in trainable)
        self.groups: list[GroupState] = self._build_groups(trainable, units)
        self._grad_tally = GradTally()  # gradient bytes held now, kept by the groups (for peak_grad_bytes)
        for g in self.groups:
            g.tally = self._grad_tally
        self._norm_weights = (optim.replica_weights(self.groups, torch.distributed.get_world_size(
            model_parallel_group)) if model_parallel_group is not None else None)
        self._publishing: list[comm.Handle] = []  # all_gathers of updated shards in flight
        masters32 = [g.layout.flatten(g.params, torch.float32, self.device) for g in self.groups]
        model.to(self.dtype)  # working precision for everything, frozen params included
        for g, m in zip(self.groups, masters32):
            self._init_group(g, m)
        del masters32
        # One torch optimizer per group's master, used as one (optim.GroupedOptimizer).
        self.optimizer = optim.make_grouped(optimizer, [g.master for g in self.groups], lr, weight_decay,
                                            momentum, betas)
        # The gradient matches the master element for element, so ranks hold different
        # parts of it exactly when masters are shards: then the norm sums over ranks.
        self.shards_grads_for_norm = any(g.master.numel() != g.layout.padded_numel for g in self.groups)
        for g in self.groups:
            for i, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, g, i))
        self._next, self._sync = 0, True  # next group to launch; this backward reduces
        self._pending: list[GroupState] = []  # groups whose reduction is in flight, oldest first
        self._no_sync_depth = 0  # > 0 inside no_sync()
        self.holds_reduced = False  # a sync backward ran since the last zero_grad()
        self.peak_grad_bytes = 0  # most gradient bytes held at once, measured
        self.temp_buffer_peak_bytes = 0  # largest fused communication buffer, bytes (Sec 6.2)
        self.in_backward = False

    # ----- the contract: what a stage must say ------------------------------------
    @abc.abstractmethod
    def _init_group(self, g: GroupState, master32: torch.Tensor) -> None:
        """Set ``g.full`` / ``g.shard`` / ``g.master`` from ``master32`` (fp32, (padded_numel,))."""

    @abc.abstractmethod
    def _reduce(self, g: GroupState) -> comm.Handle:
        """Launch the (async) sum over ranks of ``g.grad_full``; return its handle."""

    @abc.abstractmethod
    def _grad_for_step(self, g: GroupState) -> torch.Tensor:
        """The reduced gradient, shaped and placed like ``g.master``."""

    @abc.abstractmethod
    def _publish(self, g: GroupState) -> None:
        """Copy or all_gather ``g.master``'s updated values into the working parameters."""

    # ----- hooks with defaults ------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Equal shards each group is padded to: Nd (1 for a stage that shards nothing)."""
        return self.world_size

    def _build_groups(self, trainable: list[tuple[str, nn.Parameter]], units) -> list[GroupState]:
        # Reverse registration order approximates the order gradients arrive in.
        return self._groups_of(trainable[::-1])

    def _groups_of(self, named: list[tuple[str, nn.Parameter]]) -> list[GroupState]:
        """``named`` cut into buckets of at most ``bucket_mb``, each laid out flat."""
        n = self.num_shards
        return [GroupState(FlatLayout.of([name for name, _ in b], [p.shape for _, p in b], n, self.rank % n),
                           [p for _, p in b]) for b in buckets(named, self.bucket_bytes, self.dtype.itemsize)]

    def _after_reduce(self, g: GroupState) -> None:
        """Hook: ``g``'s reduction finished; keep what this rank needs (default: the
        reduction wrote its result in place, nothing to do)."""

    def _keep_reduced(self, g: GroupState) -> None:
        """Hook: a backward starts while ``g`` holds an earlier backward's reduced
        gradient; set it aside so this backward's reduction adds to it (stage 1)."""

    def _after_backward(self) -> None:
        """Hook for ZeRO-3 (free what backward left gathered)."""

    # ----- forward / backward ------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model on this rank's slice of the batch.

        Floating-point tensor arguments are cast to the working dtype (the model runs
        in it); integer ones (token ids) pass unchanged. Buffers are first broadcast
        from data-parallel rank 0 (``broadcast_buffers``), except in forwards run
        inside backward (activation-checkpoint recomputation).
        """
        if self.broadcast_buffers and not self.in_backward:
            with comm.unit("<model>", "forward: broadcast buffers"):
                for buf in self.model.buffers():
                    comm.broadcast(buf, src=self.buffer_src, group=self.pg, tag="buffers")
        cast = [a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return self.model(*cast, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ----- step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Update parameters from the reduced gradients; False if fp16 overflow skipped it.

        Global-norm clipping and the overflow check share one number: the sum of
        squares of this rank's gradient elements, all-reduced over ranks when ranks
        hold different parts (stages 1-3, and the tensor-parallel group), the same
        formula as ``torch.nn.utils.clip_grad_norm_``. Then each group in turn: its
        master steps and its update is published, so in mixed precision one group's
        fp32 gradient exists at a time (not 4 Psi / Nd bytes at once).
        """
        grads = [self._grad_for_step(g) for g in self.groups]
        used = self._used_anywhere()
        coef, found_inf = self._unscale_and_clip(grads)
        self.scaler.update(found_inf)
        if found_inf:
            return False
        for i, (g, gr) in enumerate(zip(self.groups, grads)):
            # One group at a time, so at most one group's fp32 gradient exists at once (the
            # paper's (2 + 2 + K) Psi has no fp32 gradient); each master has an optimizer of
            # its own, so stepping it costs the same however many groups there are.
            g.master.grad = gr.float() if gr.dtype != torch.float32 else gr
            if coef != 1.0:
                g.master.grad.mul_(coef)
            self.optimizer.step_group(i, self._parts_to_step(i, g, used[i]))
            g.master.grad = None
            retag(optim.optimizer_state(self.optimizer, g.master), "optimizer_states")
            self._publish_labelled(g)  # its all_gather runs while the next group steps
        self._finish_publish()
        return True

    def _used_anywhere(self) -> list[list[bool]]:
        """Per group and parameter: did any rank use it since the last ``zero_grad``?

        One all_reduce (max) of a byte per parameter, outside the ledger, as DDP's
        ``find_unused_parameters`` does: the same answer on every rank."""
        mine = [flag for g in self.groups for flag in g.used]
        if self.world_size > 1 and torch.distributed.get_backend(self.pg) != "fake":  # fake: rank 0 alone
            flags = torch.tensor(mine, dtype=torch.uint8, device=self.device)
            with comm.unit("<model>", "step: which parameters were used"):
                comm.monitor_max(flags, group=self.pg)
            mine = flags.bool().tolist()
        out, k = [], 0
        for g in self.groups:
            out.append(list(mine[k:k + len(g.params)]))
            k += len(g.params)
        return out

    def _parts_to_step(self, i: int, g: GroupState, used: list[bool]) -> list[tuple[int, int, int]] | None:
        """Ranges of group ``i``'s master to update, for parameters unused by every rank.

        None (update all of it, the common case) when every parameter of this rank's
        part was used and, for Adam, none has ever sat out a step. Else, per used
        parameter, ``(start, end, steps taken)`` in master coordinates
        (:meth:`GroupedOptimizer.step_group`); unused ones count a skipped step."""
        lo, hi = (0, g.layout.padded_numel) if g.master.numel() == g.layout.padded_numel else g.layout.shard_range
        mine = [j for j, (p, off) in enumerate(zip(g.params, g.layout.offsets)) if off < hi and off + p.numel() > lo]
        counts_steps = self.optimizer_name != "sgd"
        for j, flag in enumerate(used):
            g.skipped[j] += not flag
        if all(used[j] for j in mine) and not (counts_steps and any(g.skipped[j] for j in mine)):
            return None
        state = self.optimizer.optimizers[i].state.get(g.master, {})
        taken = int(state["step"]) if "step" in state else 0  # steps the whole group has taken
        return [(max(off, lo) - lo, min(off + g.params[j].numel(), hi) - lo, taken - g.skipped[j])
                for j in mine for off in [g.layout.offsets[j]] if used[j]]

    def _unscale_and_clip(self, grads: list[torch.Tensor]) -> tuple[float, bool]:
        """(factor to multiply the gradients by, whether fp16 overflowed on any rank)."""
        coef = 1.0 / self.scaler.scale
        if self.max_grad_norm is None and not self.scaler.enabled:
            return coef, False
        sq = optim.sum_of_squares(grads, self._norm_weights, self.device)
        with comm.unit("<model>", "step: gradient norm"):
            if self.shards_grads_for_norm and self.world_size > 1:
                comm.all_reduce(sq, group=self.pg)
            if self.mp_group is not None:  # tensor-parallel ranks hold other slices
                comm.all_reduce(sq, group=self.mp_group, tag="tp")
        norm = sq.sqrt().item() / self.scaler.scale
        found_inf = not torch.isfinite(torch.tensor(norm)).item()
        if self.max_grad_norm is not None and not found_inf:
            coef *= min(1.0, self.max_grad_norm / (norm + 1e-6))
        return coef, found_inf

    def _publish_all(self) -> None:
        """:meth:`_publish` every group, then wait for the all_gathers it launched."""
        for g in self.groups:
            self._publish_labelled(g)
        self._finish_publish()

    def _publish_labelled(self, g: GroupState) -> None:
        """:meth:`_publish` ``g``, its collectives attributed to the group in debug mode."""
        with comm.unit(g.layout.label, "step: publish"):
            self._publish(g)

    def _finish_publish(self) -> None:
        """Wait for the all_gathers :meth:`_publish` launched."""
        for handle in self._publishing:
            handle.wait()
        self._publishing.clear()

    def zero_grad(self) -> None:
        """Drop all gradients (buffers are allocated again in the next backward)."""
        for g in self.groups:
            g.grad_full = g.grad_shard = None
            g.used = [False] * len(g.params)
        self.holds_reduced = False
