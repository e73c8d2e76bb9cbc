"""MD, memory defragmentation (paper Sec 6.3), on real training steps and an allocator model.

Training interleaves tensors of very different lifetimes. In forward, a block's
checkpoint (kept until backward) is allocated between temporaries freed a moment
later; in backward, parameter gradients (kept until the step) are allocated between
recomputed activations and activation gradients. The long-lived ones end up
scattered through memory, and the free space between them is cut into pieces: an
allocation can fail while plenty of memory is free in total, just not in one piece.
In extreme cases the paper saw out-of-memory errors with over 30% of memory still
available (Sec 3.2).

ZeRO's fix is to pre-allocate contiguous pools for the long-lived tensors and copy
them in as they are produced (this package does it for real: checkpoints go to a
pool with ``CheckpointStore(contiguous=True)``, gradients to flat buffers). Here a
model of torch's caching allocator makes the effect visible anywhere, without a GPU:
device memory reserved in segments, best fit with block splitting inside them, free
blocks merging only within their segment, and, before an allocation is refused,
every segment with nothing left in it given back (:class:`CachingArena`, in
:mod:`zerolearn.residual.allocator`). A segment that still holds one live block stays
reserved, however much of it is free: that is how long-lived tensors scattered among
short-lived ones fragment memory.

:func:`record_gpt_steps` records the allocations and frees of real training steps
(``MemoryLedger(record_trace=True)``) and :func:`replay` runs them through the model,
as they happened or (``md=True``) with each class of long-lived tensors in a
pre-allocated pool of its own. On the GPT of :data:`FRAGMENTING_GPT` the step's
one large request, the buffer that flattens every gradient for the all-reduce,
fails without MD with over 40% of memory free, and fits with MD, whether the pools
are simulated or made by the step itself (``record_gpt_steps(md=True)``); on smaller
models the pools cost more than they save (chapter 5 shows both). On a GPU,
:func:`cuda_memory` runs the same steps and reads torch's own allocator statistics.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# The allocator model lives in its own module; its names are re-exported here.
from zerolearn.residual.allocator import (
    ALIGN,
    BestFit,
    CachingArena,
    Replay,
    lifetime_classes,
    pool_bytes,
    replay,
    smallest_capacity,
)

__all__ = ["ALIGN", "FRAGMENTING_GPT", "BestFit", "CachingArena", "Replay", "cuda_fragmentation", "cuda_memory",
           "lifetime_classes", "pool_bytes", "record_gpt_steps", "replay", "smallest_capacity"]

# 25.7M parameters; at batch 8 its tensors are 0.5 to 16 MiB, the sizes torch's caching
# allocator sorts into its 2 MiB and 20 MiB segments.
FRAGMENTING_GPT = dict(seq_len=512, n_layer=8, n_head=8, d_model=512)


def _gpt_steps(cfg, batch_size: int, steps: int, seed: int, fused_allreduce: bool, md: bool,
               device: str = "cpu", phase=lambda name: contextlib.nullcontext()):
    """The training steps :func:`record_gpt_steps` records; returns (model, optimizer)."""
    from zerolearn.data import gpt_batch
    from zerolearn.models import build_model
    from zerolearn.residual.checkpointing import CheckpointStore

    with torch.device(device):
        model = build_model("gpt", seed, gpt=cfg)  # the parameters: the first allocations
    params = list(model.parameters())
    model.checkpoint_store = CheckpointStore(contiguous=md)  # MD: one pool, reserved in the first forward
    if md:  # MD for gradients: one flat buffer, each .grad a view that backward accumulates into
        flat_grads = torch.zeros(sum(p.numel() for p in params), device=device)
        for p, g in zip(params, flat_grads.split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p)
    optimizer = torch.optim.Adam(params, lr=1e-3)
    for step in range(steps):
        x, y = (t.to(device) for t in gpt_batch(step, batch_size, cfg.seq_len, seed))
        with phase("forward"):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with phase("backward"):
            loss.backward()
            del loss
        with phase("step"):
            if fused_allreduce and not md:  # with MD the gradients are already one flat buffer
                grads = [p.grad for p in params]
                flat = torch.cat([g.flatten() for g in grads])
                for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                    g.copy_(part.view_as(g))
                del flat, part, g, grads
            optimizer.step()  # the first step creates Adam's states
            optimizer.zero_grad(set_to_none=not md)
            del x, y
    return model, optimizer


def record_gpt_steps(cfg=None, batch_size: int = 8, steps: int = 2, seed: int = 0,
                     fused_allreduce: bool = True, md: bool = False) -> list[tuple]:
    """Record every allocation and free of a GPT's first ``steps`` training steps, on CPU.

    The trace starts with the model's construction (its parameters are the first
    allocations) and runs training as plain data parallelism did before ZeRO:
    activation checkpointing per block (a :class:`~zerolearn.residual.checkpointing.CheckpointStore`,
    not contiguous), per-parameter gradients wherever the allocator puts them, then,
    with ``fused_allreduce``, every gradient flattened into one buffer for a single
    all-reduce (the "fuse everything" buffer of Sec 6.2) and copied back, and an Adam
    step, whose first call creates the optimizer states. On one process the
    all-reduce itself has nothing to do and is left out; its buffer is allocated all
    the same. Batches come from :func:`zerolearn.data.gpt_batch` (real text).

    With ``md=True`` the step does MD for real (Sec 6.3): checkpoints are copied into
    a contiguous pool (``CheckpointStore(contiguous=True)``) and gradients accumulate
    into one pre-allocated flat buffer, which is also what the all-reduce would send.

    Args:
        cfg: a :class:`~zerolearn.models.GPTConfig`; default ``GPTConfig(**FRAGMENTING_GPT)``.
        batch_size: sequences per step.
        steps: training steps recorded after the model's construction.

    Returns:
        ``MemoryLedger(record_trace=True).trace``: ``(event, uid, bytes, phase)`` in
        order, ``event`` "alloc" or "free", ``bytes`` the storage's size, ``phase``
        "setup" (construction), "forward", "backward" or "step". Parameters and
        optimizer states are alive when the trace ends.
    """
    from zerolearn.memory.ledger import MemoryLedger
    from zerolearn.models import GPTConfig

    cfg = cfg or GPTConfig(**FRAGMENTING_GPT)
    ledger = MemoryLedger(record_timeline=False, record_trace=True)
    with ledger:
        model, optimizer = _gpt_steps(cfg, batch_size, steps, seed, fused_allreduce, md, phase=ledger.phase)
        trace = list(ledger.trace)  # model and optimizer states are still alive: they live to the end
    return trace


def cuda_memory(cfg=None, batch_size: int = 8, steps: int = 2, seed: int = 0, md: bool = False) -> dict:
    """The steps of :func:`record_gpt_steps` run on CUDA; torch's own allocator statistics.

    Runs them after ``torch.cuda.empty_cache()`` and ``reset_peak_memory_stats()``
    and returns :func:`cuda_fragmentation` of ``torch.cuda.memory_stats()``.

    Raises:
        RuntimeError: CUDA is not available.
    """
    from zerolearn.models import GPTConfig

    if not torch.cuda.is_available():
        raise RuntimeError("defrag.cuda_memory needs a CUDA device; torch.cuda.is_available() is False")
    cfg = cfg or GPTConfig(**FRAGMENTING_GPT)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, optimizer = _gpt_steps(cfg, batch_size, steps, seed, True, md, device="cuda")
    torch.cuda.synchronize()
    stats = cuda_fragmentation(torch.cuda.memory_stats())
    del model, optimizer
    torch.cuda.empty_cache()
    return stats


def cuda_fragmentation(stats: dict) -> dict:
    """Summarise ``torch.cuda.memory_stats()``: what the caching allocator holds and why.

    Returns bytes: ``allocated`` and ``reserved`` (now and ``*_peak``), ``inactive_split``
    (free blocks inside segments that also hold live blocks, now and peak: the
    fragmentation of Sec 6.3), and the counts ``alloc_retries`` (times torch had to
    free its cache and retry a device allocation) and ``ooms``. ``fragmentation`` is
    ``1 - allocated_peak / reserved_peak``, the share of reserved memory not in use
    at the peaks (0 when nothing was reserved).
    """
    get = lambda key: int(stats.get(key, 0))  # noqa: E731
    out = {"allocated": get("allocated_bytes.all.current"), "allocated_peak": get("allocated_bytes.all.peak"),
           "reserved": get("reserved_bytes.all.current"), "reserved_peak": get("reserved_bytes.all.peak"),
           "inactive_split": get("inactive_split_bytes.all.current"),
           "inactive_split_peak": get("inactive_split_bytes.all.peak"),
           "alloc_retries": get("num_alloc_retries"), "ooms": get("num_ooms")}
    out["fragmentation"] = 1 - out["allocated_peak"] / out["reserved_peak"] if out["reserved_peak"] else 0.0
    return out
