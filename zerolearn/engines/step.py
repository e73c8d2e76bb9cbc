"""The step's half of the engine: global norm, clipping, torch's optimizer, publish.

A step updates what torch would (DDP's ``find_unused_parameters``: a parameter no rank used
since ``zero_grad`` sits out); where it runs is a placement, :class:`OnDevice` or
:class:`zerolearn.engines.offload.Offload` (ZeRO-Offload), which answer the same calls.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from zerolearn import comm
from zerolearn.engines import optim
from zerolearn.engines.backward import TrainingState
from zerolearn.engines.bindings import HeldGradient
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import retag


class OnDevice:
    """The placement without offload: torch's optimizer steps each master where it is.
    ``decides_on_host`` is False (an overflow flag stays on the device: a masked step) and
    ``delay`` None (no delayed parameter update)."""

    decides_on_host = False
    delay = None

    def land(self, engine, starts_step: bool = True) -> None:
        """Nothing in flight to finish."""

    def grads_for_step(self, engine) -> list[torch.Tensor]:
        """The stage's reduced gradient of every bucket (``_grad_for_step``)."""
        return [engine._grad_for_step(b) for b in engine.buckets]

    def take_grad(self, engine, b) -> None:
        """A reduction finished: its result stays where the stage keeps it."""

    def step(self, engine, grads: list[torch.Tensor], used: list[list[bool]], coef,
             found_inf: torch.Tensor | None) -> None:
        """Bucket by bucket: the gradient (times ``coef``) onto the fp32 master, torch's
        optimizer, publish; on CUDA in fp32, one fused step over every master first
        (:meth:`optim.GroupedOptimizer.step_all`)."""
        opt = engine._optimizer
        parts = [optim.parts_to_step(opt, i, b, used[i]) for i, b in enumerate(engine.buckets)]
        # Mixed precision steps bucket by bucket, each fp32 gradient made, used and dropped in
        # turn, so the paper's (2 + 2 + K) Psi (Sec 3.1) holds.
        at_once = opt.multi is not None and not engine.mixed and all(p is None for p in parts)
        for i, (b, grad) in enumerate(zip(engine.buckets, grads, strict=True)):
            b.master.grad = grad.float() if grad.dtype != torch.float32 else grad
            if not (isinstance(coef, float) and coef == 1.0):
                b.master.grad.mul_(coef)
            if not at_once:
                engine._step_one(i, b, parts[i], found_inf)
        if at_once:
            opt.step_all(found_inf)
            for i, b in enumerate(engine.buckets):
                engine._step_one(i, b, None, None, stepped=True)
        engine._finish_publish()

    def shard_in(self, b) -> None:
        """The working shard is in memory already."""

    def shard_out(self, b) -> None:
        """Nothing to release."""

    def publishing(self, b):
        """Nothing around a publish."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        """No host gradient to drop."""

    def wait(self) -> None:
        """No host step in flight."""

    def stats(self) -> dict[str, float]:
        """No disk I/O: zeros."""
        return {"bytes_read": 0, "bytes_written": 0, "io_seconds": 0.0, "read_bandwidth": 0.0,
                "write_bandwidth": 0.0}

    def close(self) -> None:
        """Nothing to release."""


class Stepping:
    """The engine's step (mixed into :class:`zerolearn.engines.base.Engine`)."""

    def step(self) -> bool | optim.Stepped:
        """Update parameters from the reduced gradients: ``engine.optimizer.step()``
        (:meth:`optim.GroupedOptimizer.step`), seen by LR schedulers and step hooks; a change to
        ``engine.optimizer.param_groups[0]`` applies from this step.

        Returns:
            True when no overflow check ran (fp32 or bf16 without ``max_grad_norm``); else an
            :class:`optim.Stepped`, False under ``bool()`` (a read of the device flag) when an
            overflow (fp16, or a non-finite norm under clipping) skipped the step.
        """
        self._check_open()
        self._optimizer.step()
        return self._optimizer.stepped

    @torch.no_grad()
    def _step(self) -> bool | optim.Stepped:
        """See :meth:`step`. One global gradient norm serves clipping and the overflow check;
        as in torch's ``GradScaler`` it stays a device tensor and an overflowed step is masked
        away. The host reads the flag only for a host step (offload) or an unused parameter."""
        self._check_open()
        if self.state is not TrainingState.IDLE:
            self._recover()
        self._refuse_partial()
        self._bindings.check("step")
        self._check_exposed()
        self._absorb_changes()
        for b in self.buckets:  # a gradient kept without a reduction (stage 0-1, no_sync) is read whole
            self._zero_unwritten(b)
        place = self._placement
        place.land(self)  # DPU: the update in flight finishes and is published
        grads = place.grads_for_step(self)
        if self._used_flags is None:  # no reducing backward since zero_grad
            self._exchange_used_flags()
        used = self._used_anywhere()
        self._optimizer.push_hyperparameters()  # an LR scheduler's lr, a hand-set one
        coef, found_inf = self._unscale_and_clip(grads)
        if found_inf is not None:
            self.scaler.update(found_inf)
            if place.decides_on_host or not all(all(u) for u in used):
                if bool(found_inf):  # the host decides this step's work: read the flag
                    return False
                coef, found_inf = float(coef), None
        place.step(self, grads, used, coef, found_inf)
        return True if found_inf is None else optim.Stepped(found_inf)

    def _step_one(self, i: int, b, parts, found_inf: torch.Tensor | None, stepped: bool = False) -> None:
        """Step bucket ``b``'s master (unless ``stepped``), drop its gradient, tag its state, publish."""
        if not stepped:
            self._optimizer.step_bucket(i, parts, found_inf)
        b.master.grad = None
        retag(optim.optimizer_state(self._optimizer, b.master), "optimizer_states")
        with comm.unit(b.layout.label, "step: publish"):
            self._publish(b)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (buffers are allocated again in the next backward).

        Args:
            set_to_none: as torch's; False: a parameter that had a gradient keeps a zero one
                and is stepped (stage 0's ``p.grad`` reads zeros).
        """
        if self.state is not TrainingState.IDLE:
            self._recover()  # a backward that failed before its end: its partial gradients go too
        self._partial = False
        if self._used_flags is not None:
            self._used_anywhere()  # an exchange nobody stepped with: finish it
        if set_to_none:
            self._kept_grads = None
        elif self._last_used is not None:
            kept = self._kept_grads or [[False] * len(b.params) for b in self.buckets]
            self._kept_grads = [[k or u for k, u in zip(ks, us, strict=True)]
                                for ks, us in zip(kept, self._last_used, strict=True)]
        self._last_used = None
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
        self._placement.zero_grad()
        self.holds_reduced = False

    def _exchange_used_flags(self, reduced: bool = False) -> None:
        """Start finding out which parameters any rank used since ``zero_grad``: an all_reduce
        (max, outside the ledger) of a byte per parameter, as DDP does. ``reduced`` (stage 0):
        on the CPU (:attr:`flags_from_grads`) only if a parameter's reduced gradient is all 0."""
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
        """Whether every parameter's part of ``grad_full`` holds a nonzero (NaN, inf: yes) element."""
        for b, firsts in zip(self.buckets, self._first_elements, strict=True):
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
        """Per bucket, each parameter's offset in ``grad_full`` (int64); None if one is empty."""
        return [torch.tensor(b.layout.offsets, dtype=torch.int64, device=self.device)
                if all(math.prod(shape) > 0 for shape in b.layout.shapes) else None for b in self.buckets]

    @functools.cached_property
    def flags_from_grads(self) -> bool:
        """Stage 0 (``replicated_grads``) learns which parameters were used from the reduced
        gradient, a host read of it, only where the host holds it (the CPU)."""
        return self.device.type == "cpu"

    def _used_anywhere(self) -> list[list[bool]]:
        """Per bucket and parameter: is it stepped (used by any rank since ``zero_grad``, or
        a zero gradient kept by ``zero_grad(set_to_none=False)``)? Waits for the exchange."""
        flags, pending = self._used_flags
        if pending is not None:
            pending.wait()
        self._used_flags = None
        if all(all(b.used) for b in self.buckets):
            out = [[True] * len(b.params) for b in self.buckets]
        else:
            mine, out, k = flags.bool().tolist(), [], 0
            for b in self.buckets:
                out.append(mine[k:k + len(b.params)])
                k += len(b.params)
        if self._kept_grads is not None:  # torch steps a zero p.grad
            out = [[u or kept for u, kept in zip(us, ks, strict=True)]
                   for us, ks in zip(out, self._kept_grads, strict=True)]
        self._last_used = out
        return out

    def _global_sum_of_squares(self, grads: list[torch.Tensor], when: str) -> torch.Tensor:
        """Sum of squares of the whole reduced gradient (still loss-scaled), an fp32 device scalar:
        this rank's part, summed over the ranks holding other parts."""
        sq = optim.sum_of_squares(grads, self._norm_weights, self.device).to(self.device)
        with comm.unit("<model>", f"{when}: gradient norm"):
            if self.shards_grads_for_norm and self.world_size > 1:
                comm.all_reduce(sq, group=self.pg)
            if self.mp_group is not None:  # tensor-parallel ranks hold other slices
                comm.all_reduce(sq, group=self.mp_group, tag="tp")
        return sq

    def _unscale_and_clip(self, grads: list[torch.Tensor]) -> tuple[float | torch.Tensor, torch.Tensor | None]:
        """(gradient factor, overflow flag): ``(1.0, None)`` without clipping or fp16; else a
        float64 0-dim device tensor ``1 / scale * min(1, max_grad_norm / (norm + 1e-6))``
        (torch's ``clip_grad_norm_``; 1 on overflow) and a bool one, ``not isfinite(norm)``."""
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

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the reduced gradient, between backward and step
        (``max_grad_norm=`` does it in every step): the global 2-norm, a collective (call on every
        rank), and the gradient scaled in place by torch's ``min(1, max_norm / (norm + 1e-6))``.

        Returns:
            the norm before clipping, an fp32 scalar tensor without fp16's loss scale (inf or
            NaN on overflow, and then nothing is scaled: the step skips).

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
        self._placement.land(self, starts_step=False)
        grads = self._placement.grads_for_step(self)
        grads = [g if g is not None else torch.zeros(0, device=self.device) for g in grads]
        sq = self._global_sum_of_squares(grads, "clip_grad_norm_")
        norm = sq.sqrt() / self.scaler.scale_tensor.to(sq.dtype)
        # On the device (no host read): a non-finite norm scales nothing (factor 1).
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    def _full_versions(self) -> list[int] | None:
        """Version counters of the working buffers (stages 0-2 without offload; else None)."""
        if self._offload is not None or self.stage not in (0, 1, 2):
            return None
        return [b.full._version for b in self.buckets]

    def _absorb_changes(self) -> None:
        """Changes to working parameters since the last publish (``p.clamp_()`` under no_grad,
        outside :meth:`summon_full_params`) go to the master, as they would stay in torch."""
        if self._versions is None:
            return
        for b, version in zip(self.buckets, self._versions, strict=True):
            if b.full._version != version:
                with torch.no_grad():
                    self._write_back(b)
        self._versions = self._full_versions()

    def _publish_all(self) -> None:
        """:meth:`_publish` every bucket, then wait for the all_gathers it launched."""
        for b in self.buckets:
            with comm.unit(b.layout.label, "step: publish"), self._placement.publishing(b):
                self._publish(b)
        self._finish_publish()

    def _finish_publish(self) -> None:
        for handle in self._publishing:
            handle.wait()
        self._publishing.clear()
        self._versions = self._full_versions()

    @property
    def optimizer(self) -> optim.GroupedOptimizer:
        """torch's optimizer over the masters (:class:`optim.GroupedOptimizer`); under DPU a
        read waits for the host step in flight, so its state is never half updated."""
        self._placement.wait()
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: optim.GroupedOptimizer) -> None:
        self._optimizer = value

    def finish_dpu(self) -> None:
        """Wait for the DPU host step in flight and publish it, so the working parameters equal
        the masters (a collective at stages 1-2: call on every rank); else a no-op."""
        if self._placement.delay is not None:
            self._placement.land(self, starts_step=False)

    def offload_stats(self) -> dict[str, float]:
        """Disk I/O of the last step (``offload="disk"``; zeros otherwise): ``bytes_read``,
        ``bytes_written`` (bytes), ``io_seconds`` (s), ``read_bandwidth``, ``write_bandwidth``
        (bytes/s; 0.0 without I/O). Under DPU it waits for the step in flight and also counts the
        masters read to publish the previous update."""
        return self._placement.stats()
