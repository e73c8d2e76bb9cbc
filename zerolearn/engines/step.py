"""The step's half of the engine: global norm, clipping, torch's optimizer, publish.

Which parameters a step updates follows torch: one no rank used since ``zero_grad`` is
left alone (no momentum, Adam moment or step count, weight decay); one some rank used
gets the average with zeros from the others (DDP, ``find_unused_parameters``); after
``zero_grad(set_to_none=False)`` a parameter that had a gradient keeps a zero one, so
it is stepped, as torch steps a zero ``p.grad``.

Where the update runs is a *placement*: :class:`OnDevice` (torch's optimizer on the
device, bucket by bucket, or one fused multi-tensor step on CUDA) or
:class:`zerolearn.engines.offload.Offload` (the host's step, ZeRO-Offload, with its
states on disk for ZeRO-Infinity). Both answer the same calls (``land``,
``grads_for_step``, ``step``, ``take_grad``, ``publishing``, ...), so the step has no
branch on where it runs.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from zerolearn import comm
from zerolearn.engines import optim
from zerolearn.engines.bindings import HeldGradient
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import retag


class OnDevice:
    """The placement without offload: torch's optimizer steps each master where it is.

    Attributes:
        decides_on_host: False: an overflow flag stays on the device (a masked step).
        delay: None (no delayed parameter update).
    """

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
        optimizer, publish; on CUDA in fp32 one fused step over every master first
        (:meth:`optim.GroupedOptimizer.step_all`)."""
        opt = engine._optimizer
        parts = [optim.parts_to_step(opt, i, b, used[i]) for i, b in enumerate(engine.buckets)]
        # One multi-tensor step over every master (CUDA) where the gradients already are fp32
        # buffers; in mixed precision each bucket's fp32 gradient is made, used and dropped in
        # turn, so the (2 + 2 + K) Psi of the paper holds: those step bucket by bucket.
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
        """The step itself (see :meth:`step`): one number, the global gradient norm
        (``clip_grad_norm_``'s formula, summed over ranks that hold different parts), serves
        clipping and the overflow check; then the placement updates and publishes each
        bucket (:meth:`OnDevice.step`, or offload's host step).

        Nothing waits for the host to read a device value, as torch's ``GradScaler``
        steps: the norm, the clipping factor and the overflow flag stay 0-dim device
        tensors, an overflowed step is computed and then masked away (``torch.where`` on
        the flag). Two cases read the flag on the host, as their work is decided there: a
        placement that steps on the host (offload) and a step in which some parameter
        sits out (no rank used it: its elements are stepped apart).
        """
        self._check_open()
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
        """Bucket ``b``'s master stepped (unless ``stepped``: :meth:`optim.GroupedOptimizer.step_all`
        did), its gradient dropped, its state tagged for the ledger, the update published."""
        if not stepped:
            self._optimizer.step_bucket(i, parts, found_inf)
        b.master.grad = None
        retag(optim.optimizer_state(self._optimizer, b.master), "optimizer_states")
        with comm.unit(b.layout.label, "step: publish"):
            self._publish(b)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (buffers are allocated again in the next backward).

        Args:
            set_to_none: as torch's: True, every ``p.grad`` becomes None; False, a parameter
                that had a gradient keeps a zero one, so the next step updates it, as torch
                steps a zero ``p.grad`` (momentum, weight decay); at stage 0 the buckets are
                kept and zeroed, so ``p.grad`` reads zeros.
        """
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

    # ----- which parameters were used ----------------------------------------------------
    def _exchange_used_flags(self, reduced: bool = False) -> None:
        """Start finding out which parameters any rank used since ``zero_grad``: one
        all_reduce (max) of a byte per parameter, outside the ledger, as DDP does.

        ``reduced``: called, at a stage with ``replicated_grads`` (stage 0), once a reducing
        backward's reductions all finished: every rank then holds the same whole reduced
        gradient, which answers first. A rank that did not use a parameter adds zeros, so a
        parameter whose reduced gradient has a nonzero element was used by some rank. Only
        if some parameter's reduced gradient is all zeros do the ranks exchange flags. That
        read is the host's, so only the CPU answers from the gradient
        (:attr:`flags_from_grads`); on an accelerator the flags travel in every step.
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
        """Per bucket, the offset of each parameter in ``grad_full`` (int64, one per parameter);
        None for a bucket with an empty parameter, which has no element to tell."""
        return [torch.tensor(b.layout.offsets, dtype=torch.int64, device=self.device)
                if all(math.prod(shape) > 0 for shape in b.layout.shapes) else None for b in self.buckets]

    @functools.cached_property
    def flags_from_grads(self) -> bool:
        """Stage 0 (``replicated_grads``) learns which parameters were used from the reduced
        gradient, a host read of it, only where the host holds it (the CPU)."""
        return self.device.type == "cpu"

    def _used_anywhere(self) -> list[list[bool]]:
        """Per bucket and parameter: is it stepped? Used by any rank since ``zero_grad``
        (:meth:`_exchange_used_flags`, waited for here), or holding a zero gradient kept by
        ``zero_grad(set_to_none=False)``. Only a rank that left a parameter unused reads
        the exchanged flags (a host read)."""
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

    # ----- the global norm ---------------------------------------------------------------
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
        ``not isfinite(norm)``, the same on every rank (the norm is summed over them).
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

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the engine's reduced gradient, between
        backward and step: the global 2-norm over every trainable parameter (summed over
        the ranks that hold different parts: a collective, call it on every rank), and the
        gradient scaled in place by ``min(1, max_norm / (norm + 1e-6))``, as torch does.
        ``max_grad_norm=`` of the engine does the same inside every step.

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
        self._placement.land(self, starts_step=False)
        grads = self._placement.grads_for_step(self)
        grads = [g if g is not None else torch.zeros(0, device=self.device) for g in grads]
        sq = self._global_sum_of_squares(grads, "clip_grad_norm_")
        norm = sq.sqrt() / self.scaler.scale_tensor.to(sq.dtype)
        # Decided on the device (no host read): a non-finite norm scales nothing (factor 1).
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    # ----- publish -------------------------------------------------------------------------
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

    # ----- the optimizer and the placement ---------------------------------------------------
    @property
    def optimizer(self) -> optim.GroupedOptimizer:
        """torch's optimizer over the masters (:class:`optim.GroupedOptimizer`). Under DPU a
        read waits for the host step in flight, so whoever reads its state (a checkpoint)
        sees the finished update, never one half done."""
        self._placement.wait()
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: optim.GroupedOptimizer) -> None:
        self._optimizer = value

    def finish_dpu(self) -> None:
        """Wait for the DPU host step in flight and publish its update, so the working
        parameters equal the masters (a collective at stages 1-2: call on every rank).
        A no-op without DPU or with nothing in flight."""
        if self._placement.delay is not None:
            self._placement.land(self, starts_step=False)

    def offload_stats(self) -> dict[str, float]:
        """Disk I/O of the last step (``offload="disk"``; zeros otherwise): ``bytes_read``,
        ``bytes_written`` (bytes), ``io_seconds`` (s), ``read_bandwidth``,
        ``write_bandwidth`` (bytes/s; 0.0 without I/O). Under DPU it waits for the step
        in flight and also counts the masters read to publish the previous update."""
        return self._placement.stats()
