"""Activation checkpointing with ZeRO-R's P_a, P_a+cpu and contiguous pools (Sec 6.1, 6.3).

With activation checkpointing a transformer block keeps only its input (batch x seq
x hidden values, the *checkpoint*) through forward and recomputes everything else in
backward (Sec 3.2: about 33% more compute for a large cut in activation memory).
ZeRO-R then removes what is still redundant about those checkpoints:

* **P_a** (``partition=True``): under model parallelism every one of the Nm ranks of
  a block holds the same checkpoint. Each keeps 1/Nm of it instead and they
  all-gather it just before the recomputation: one all-gather of seq x batch x
  hidden per block, small beside the block's own all-reduces (Sec 8).
* **P_a+cpu** (``cpu=True``): the (partitioned) checkpoint waits in host memory
  between forward and backward; device memory for checkpoints drops to ~0 for the
  price of two host-device copies per block (pinned memory and a side stream on CUDA).
* **MD** for checkpoints (``contiguous=True``): checkpoints are copied into one
  pre-allocated contiguous pool instead of living wherever the allocator put them
  among short-lived tensors, so they cannot fragment memory (Sec 6.3).

Why not ``torch.utils.checkpoint``: it holds the block's input by reference inside
its recompute closure, with no way to partition or move it. :func:`checkpoint`
below is the classic re-entrant scheme (forward without a graph, recompute and
backward inside the backward of one autograd node) with the checkpoint owned by a
:class:`CheckpointStore`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolearn import comm


@dataclass
class _Saved:
    data: torch.Tensor  # what is held: the whole input, or this rank's 1/Nm chunk
    shape: torch.Size
    numel: int
    device: torch.device


class CheckpointStore:
    """Holds each block's checkpoint from forward until its recomputation.

    Args:
        partition: P_a, keep 1/Nm of each checkpoint (needs ``group``).
        cpu: P_a+cpu, keep checkpoints in host memory.
        contiguous: copy device checkpoints into one pre-allocated pool (MD).
        group: the Nm model-parallel ranks that share each checkpoint.

    Attributes: ``transfer_seconds`` (host-device copy time, s), ``gathered_elements``
    (elements all-gathered for P_a), both totals since construction.
    """

    def __init__(self, *, partition: bool = False, cpu: bool = False, contiguous: bool = False,
                 group=None):
        self.partition, self.cpu, self.contiguous, self.group = partition, cpu, contiguous, group
        self.nm = dist.get_world_size(group) if partition else 1
        self.rank = dist.get_rank(group) if partition else 0
        self.saved: dict[int, _Saved] = {}
        self._next_handle = 0
        self._pool: torch.Tensor | None = None
        self._pool_used = 0
        self.transfer_seconds = 0.0
        self.gathered_elements = 0
        self._stream = None

    # ----- forward: keep (a part of) the checkpoint ------------------------------------
    def save(self, x: torch.Tensor) -> int:
        """Take the checkpoint ``x`` (any shape); return a handle for :meth:`load`."""
        flat = x.detach().reshape(-1)
        if self.partition:
            chunk = math.ceil(flat.numel() / self.nm)
            padded = torch.nn.functional.pad(flat, (0, chunk * self.nm - flat.numel()))
            flat = padded[self.rank * chunk:(self.rank + 1) * chunk]
        if self.cpu:
            held = self._to_host(flat)
        elif self.contiguous:
            held = self._pool_slice(flat)
        else:
            held = flat.clone() if self.partition else flat  # a chunk must not pin the full tensor
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.saved[handle] = _Saved(held, x.shape, x.numel(), x.device)
        return handle

    def _to_host(self, flat: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if flat.is_cuda:
            # A side stream lets the copy run while the next block computes.
            self._stream = self._stream or torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            with torch.cuda.stream(self._stream):
                host.copy_(flat, non_blocking=True)
            flat.record_stream(self._stream)
        else:
            host = flat.clone()
        self.transfer_seconds += time.perf_counter() - t0
        return host

    def _pool_slice(self, flat: torch.Tensor) -> torch.Tensor:
        if self._pool is None or self._pool_used + flat.numel() > self._pool.numel():
            raise RuntimeError("contiguous checkpoint pool too small: call reserve() before forward")
        out = self._pool[self._pool_used:self._pool_used + flat.numel()]
        self._pool_used += flat.numel()
        return out.copy_(flat)

    def reserve(self, count: int, example: torch.Tensor) -> None:
        """Pre-allocate the MD pool for ``count`` checkpoints shaped like ``example``."""
        if not self.contiguous:
            return
        need = count * math.ceil(example.numel() / self.nm)
        if self._pool is None or self._pool.numel() < need or self._pool.dtype != example.dtype:
            self._pool = torch.empty(need, dtype=example.dtype, device=example.device)
        self._pool_used = 0

    def checkpoint(self, run, x: torch.Tensor) -> torch.Tensor:
        """``run(x)``, with only ``x`` kept here for backward, which recomputes ``run``
        (:func:`checkpoint` on this store). A model with a store calls it per block."""
        return checkpoint(run, x, self)

    # ----- backward: bring it back --------------------------------------------------------
    def load(self, handle: int) -> torch.Tensor:
        """The full checkpoint for ``handle``, on its device; the store lets go of it."""
        saved = self.saved.pop(handle)
        part = saved.data
        if self.cpu:
            t0 = time.perf_counter()
            if self._stream is not None:
                torch.cuda.current_stream().wait_stream(self._stream)
            part = part.to(saved.device, non_blocking=True)
            self.transfer_seconds += time.perf_counter() - t0
        if self.partition:
            full = torch.empty(part.numel() * self.nm, dtype=part.dtype, device=part.device)
            comm.all_gather(full, part.contiguous(), group=self.group, tag="pa")
            self.gathered_elements += full.numel()
            part = full
        return part[:saved.numel].view(saved.shape)

    def bytes_held(self) -> tuple[int, int]:
        """(device bytes, host bytes) of the checkpoints held now (the MD pool counts whole)."""
        device = host = 0
        for s in self.saved.values():
            nbytes = s.data.numel() * s.data.element_size()
            if self.cpu:
                host += nbytes
            elif not self.contiguous:
                device += nbytes
        if self._pool is not None:
            device += self._pool.numel() * self._pool.element_size()
        return device, host


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, store: CheckpointStore, x: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.store = run, store
        ctx.handle = store.save(x)
        with torch.no_grad():  # no graph: the block's activations are not kept
            return run(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x = ctx.store.load(ctx.handle).detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.run(x)  # recompute the block, this time with a graph
        torch.autograd.backward(y, grad)
        return None, None, x.grad


def checkpoint(run, x: torch.Tensor, store: CheckpointStore) -> torch.Tensor:
    """``run(x)`` keeping only ``x`` (in ``store``) for backward, which recomputes ``run``.

    ``run`` must be deterministic (our blocks have no dropout) and take and return
    one tensor (batch, seq, hidden).
    """
    return _Checkpoint.apply(run, store, x)
