"""Stage 3, P_os+g+p: partition the parameters too (paper Sec 5.3, Sec 7.2.2).

A unit is freed by resizing its buffer's *storage* to 0 bytes, not by reassigning ``param.data``: the
weights autograd saved for backward are views of that storage, and see the values gathered again."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from zerolearn import comm, guard
from zerolearn.engines import units as U
from zerolearn.engines import zero3_checks as C
from zerolearn.engines.base import Bucket, Engine, TrainingState
from zerolearn.engines.zeropp_units import ZeroPP


class Zero3Engine(Engine):
    """Stage 3 (P_os+g+p): sharded params, grads and optimizer states; a unit gathered for its forward and backward.

    Memory per rank (bytes): (2 + 2 + K) Psi / Nd (+ padding; Fig 1), plus the unit computing and one
    prefetch of up to ``prefetch_mb`` MiB in one fused all_gather (CB, Sec 6.2; :func:`units.prefetch_bytes`).
    Traffic per step: all_gather 2 Psi + reduce_scatter Psi elements, 1.5x DP's (Sec 7.2.2). Units
    (``units=``; :func:`units.assign`, shared parameters to the root unit as in FSDP2 and DeepSpeed) are read
    only inside their own forward, in the same order on every rank; between steps, :meth:`summon_full_params`.

    Raises:
        ConfigError: a bad ``prefetch_mb``, a unit without a forward, a compiled model, ``load_state_dict``
            outside :meth:`summon_full_params`, a read outside a unit's forward, ranks at different units.
    """

    stage = 3

    def __init__(self, model: nn.Module, *, prefetch_mb: float | None = None, node_ranks=None, qwz_block=None,
                 hpz=False, qgz=False, **options):
        self.prefetch_bytes = U.prefetch_bytes(prefetch_mb)  # small units: several per prefetch, one all_gather
        self.zpp = ZeroPP(node_ranks, qwz_block, hpz, qgz, options.get("group"))  # ZeRO++, checked first
        U.refuse_compiled(model)
        super().__init__(model, **options)

    def _build_buckets(self, trainable, units) -> list[Bucket]:
        modules, per_unit, names = U.assign(self.model, units, trainable)
        self.units, buckets = [], []
        for u in [*reversed(range(len(modules) - 1)), len(modules) - 1]:  # backward order, the root's last
            if per_unit[u]:
                mine = self._buckets_of(per_unit[u][::-1], small_first=False)  # a unit starts its own
                self.units.append(U.Unit(u, names.get(id(modules[u]), type(modules[u]).__name__), modules[u], mine))
                buckets += mine
        self.units.sort(key=lambda unit: unit.index)  # forward order
        self._unit_of = {id(b): unit for unit in self.units for b in unit.buckets}
        self._param_unit = {id(p): (name, unit) for unit in self.units for b in unit.buckets
                            for name, p in zip(b.layout.names, b.params, strict=True)}
        self._reached = U.Reached([u for u in self.units if u.module is not self.model], self._param_unit)
        self._position = {id(b): k for k, b in enumerate(buckets)}  # launch order
        self.zeros_counted = 0  # the last backward's parameters counted as zeros (units.Reached.count)
        self.schedule = U.Schedule(self.units, self.units[-1].module is self.model, self.pg, self.device,
                                   min(self.prefetch_bytes, self.bucket_bytes))  # a fused buffer <= CB
        self._storage_unit: dict[int, U.Unit] = {}  # a storage autograd may save -> its unit
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full parameters alive now / at most
        me = weakref.ref(self)  # the model's hooks must not keep the engine alive (close() or not)
        self._module_hooks = (U.unit_hooks(self.units, lambda u: (e := me()) and e._pre_forward(u),  # gather, free
                                           lambda u, out: (e := me()) and e._post_forward(u, out))
                              + C.guard_load_state_dict(self.model, self._param_unit))  # load outside a summon
        return buckets

    def _init_bucket(self, b: Bucket, master32: torch.Tensor) -> None:
        full = master32.to(self.dtype)
        b.shard = b.layout.shard_of(full).clone()  # the only copy of the working params kept
        b.master = nn.Parameter(b.shard if not self.separate_master else b.layout.shard_of(master32).clone())
        b.full = full
        b.layout.bind(b.params, full)  # parameters are views of the full buffer, whose storage we free
        self._storage_unit[U.storage_key(full)] = self._unit_of[id(b)]
        b.full.untyped_storage().resize_(0)
        U.ShardedParameter.adopt(b, self._unit_of[id(b)])  # a read while freed raises, never reads freed memory

    def _start_gather(self, units: list[U.Unit]) -> None:  # a unit, or a prefetch's window: fused
        if not units or units[0].gathered or units[0].gathering:
            return  # started earlier, with an earlier window
        units = [unit for unit in units if not (unit.gathered or unit.gathering)]
        buckets = [b for unit in units for b in unit.buckets]
        for b in buckets:
            self._placement.shard_in(b)  # offload="disk": the shard read from its file first (ZeRO-Infinity)
            b.full.untyped_storage().resize_(b.full.nbytes)
            self.gathered_bytes += b.full.nbytes
        fuse = len(units) > 1 and self.world_size > 1 and self.offload != "disk" and not self.zpp.enabled
        group = comm.phase_group(self.pg, "backward" if self.in_backward else "forward")  # gloo: a twin per phase
        fused = U.FusedGather(buckets, group) if fuse else None
        for unit in units:  # else one all_gather per bucket
            unit.gathering = [fused or self._all_gather(b, group) for b in unit.buckets]
        peak = fused.nbytes if fused else max(b.full.nbytes for b in buckets)
        self.temp_buffer_peak_bytes = max(self.temp_buffer_peak_bytes, peak)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _all_gather(self, b: Bucket, group) -> comm.Handle:  # b.full from every rank's b.shard
        if self.zpp.enabled:
            return self.zpp.gather(b, self.in_backward, group)  # ZeRO++: qwZ quantized, or hpZ in the node
        return comm.all_gather(b.full, b.shard, group=group, async_op=True)

    def _finish_gather(self, unit: U.Unit) -> None:
        for b, handle in zip(unit.buckets, unit.gathering, strict=False):  # one per bucket; none if not gathering
            handle.wait()
            self._placement.shard_out(b)  # offload="disk": the shard's memory released, its file kept
        unit.gathered = unit.gathered or bool(unit.gathering)
        unit.gathering.clear()

    def _gather(self, unit: U.Unit) -> None:
        self._start_gather([unit])
        self._finish_gather(unit)

    def _free_bucket(self, b: Bucket) -> None:
        self.gathered_bytes -= b.full.untyped_storage().nbytes()
        b.full.untyped_storage().resize_(0)

    def _free_unit(self, unit: U.Unit) -> None:
        self._finish_gather(unit)  # never free a buffer an all_gather is still writing
        for b in unit.buckets:
            self._free_bucket(b)
        unit.gathered = False

    def _previous(self, unit: U.Unit) -> list[U.Unit]:  # backward's prefetch: the units before, a window
        i = self.units.index(unit)
        return self.schedule.window(self.units[i - 1::-1]) if i > 0 else []

    def forward(self, *args, **kwargs):
        self.schedule.start()  # also: no unit has run yet
        reads = C.ReadGuard(self._param_unit) if guard.debug_enabled() else contextlib.nullcontext()
        try:
            with reads, torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = super().forward(*args, **kwargs)
            self.schedule.finish()  # the next forward's schedule (debug mode: checked on every rank)
            self._settle()  # a prefetch the forward did not use
            return out
        except (guard.CollectiveError, guard.CollectiveMismatch):
            raise  # the process group is broken: waiting on it would hang
        except BaseException:
            self._settle()
            raise
        finally:
            self.schedule.stop()

    def _pre_forward(self, unit: U.Unit) -> None:
        U.refuse_compiling()
        recompute = self.in_backward  # activation checkpointing recomputes inside backward
        unit.ran = unit.ran or not recompute
        with comm.unit(unit.name, "forward: gather"):
            ahead = self._previous(unit) if recompute else self.schedule.enter(unit)  # recomputing: in reverse
            self._gather(unit)  # this unit first: a prefetch launched before it would queue ahead of it
            self._start_gather(ahead)

    def _post_forward(self, unit: U.Unit, output):
        if self.in_backward:
            return None  # recomputed for backward, which needs the parameters next: keep them
        output = U.own_copies(output, self._storage_unit, unit)  # a view of the buffer, copied before the free
        self.schedule.exit(unit)
        self._free_unit(unit)
        if torch.is_grad_enabled():  # the hooks run just before this unit's backward
            for t in U.tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        return output

    def _before_backward(self, roots: list) -> None:
        self.zeros_counted = 0  # reached units' parameters with no gradient here (an idle expert): zeros
        if self.world_size > 1 and roots:
            self.zeros_counted = self._reached.count(roots, self.units, self.pg, self.device,  # debug: agreed
                                                     C.agree_backward if guard.debug_enabled() else None)

    def _pre_backward(self, unit: U.Unit) -> None:
        self._ensure_backward()  # loss.backward(): the engine's backward starts here
        if unit.backward_gathered:
            return
        unit.backward_gathered = True
        with comm.unit(unit.name, "backward: gather"):
            self._gather(unit)
            self._start_gather(self._previous(unit))
        self._launch_arrived(unit)

    def _launch_arrived(self, unit: U.Unit) -> None:  # buckets complete (zeros counted) before its backward
        if self.state is TrainingState.PRE_BACKWARD:
            for b in unit.buckets:
                if b.complete and self._position[id(b)] >= self._next:  # not launched yet
                    if not self._accumulating:
                        self._start_accumulating()
                    self._on_bucket_ready(b)

    def _pack(self, t: torch.Tensor):
        return t if (unit := self._storage_unit.get(U.storage_key(t))) is None else U.Saved(t, unit)

    def _unpack(self, saved):  # a saved tensor of a unit's buffer comes back gathered, whatever its outputs
        if isinstance(saved, U.Saved):
            self._ensure_backward()  # loss.backward() reached a saved weight first
            if not saved.unit.gathered:
                saved.unit.backward_gathered = True
                with comm.unit(saved.unit.name, "backward: gather"):
                    self._gather(saved.unit)
                self._launch_arrived(saved.unit)
            return saved.tensor
        return saved

    def _on_bucket_ready(self, b: Bucket) -> None:  # b's gradients are all in: its parameters can go
        unit = self._unit_of[id(b)]
        self._finish_gather(unit)
        self._free_bucket(b)
        if all(other.complete for other in unit.buckets):
            self._free_unit(unit)
        super()._on_bucket_ready(b)

    def _may_launch(self, b: Bucket) -> bool:  # the root unit's buckets: reduced at backward's end
        unit = self._unit_of[id(b)]  # a bucket complete before its unit's backward waits for it
        return b.complete and unit.module is not self.model and unit.backward_gathered

    def _reduce(self, b: Bucket) -> comm.Handle:  # as ZeRO-2: into the kept shard, or a temporary if accumulating
        out = self._new_grad(b.layout.shard_numel)
        if b.grad_shard is None:
            b.grad_shard = out
        else:
            b.reduced = out
        if self.zpp.qgz:
            return self.zpp.reduce_scatter(out, b.grad_full)  # ZeRO++'s qgZ: a quantized two-hop all-to-all
        return comm.reduce_scatter(out, b.grad_full, group=self.pg, async_op=True, overwrite_input=True)

    def _after_reduce(self, b: Bucket) -> None:
        b.grad_full = None  # the full gradient bucket is no longer needed: free it now
        if b.reduced is not None:
            b.grad_shard.add_(b.reduced)
            b.reduced = None

    def _settle(self) -> None:  # after forward, backward or a failure: finish every gather, free all
        for unit in self.units:
            self._free_unit(unit)
            unit.backward_gathered = False

    def _summon(self) -> None:  # summon_full_params: every unit gathered until _unsummon
        for unit in self.units:
            with comm.unit(unit.name, "summon_full_params: gather"):
                self._gather(unit)

    _unsummon = _settle  # the end of summon_full_params: every unit freed
    _after_backward = _settle  # units some of whose parameters got no gradient are still gathered (or it failed)

    def _grad_for_step(self, b: Bucket) -> torch.Tensor:
        return b.grad_shard

    def _publish(self, b: Bucket) -> None:
        if self.separate_master:  # mixed precision, or offload's host master
            b.shard.copy_(b.master)
