"""MD, memory defragmentation (paper Sec 6.3), on real training steps and an allocator model.

Training interleaves tensors of very different lifetimes. In forward, a block's
checkpoint (kept until backward) is allocated between temporaries freed a moment
later; in backward, parameter gradients (kept until the step) are allocated between
recomputed activations and activation gradients. The long-lived ones end up
scattered through memory, and the free space between them is cut into pieces: an
allocation can fail while plenty of memory is free in total, just not in one piece.
The paper saw out-of-memory with over 30% of memory still free.

ZeRO's fix is to pre-allocate contiguous pools for the long-lived tensors and copy
them in as they are produced (this package does it for real: checkpoints go to a
pool with ``CheckpointStore(contiguous=True)``, gradients to flat buffers). Here a
model of torch's caching allocator makes the effect visible anywhere, without a GPU:
device memory reserved in segments, best fit with block splitting inside them, free
blocks merging only within their segment, and, before an allocation is refused,
every segment with nothing left in it given back (:class:`CachingArena`). A segment
that still holds one live block stays reserved, however much of it is free: that is
how long-lived tensors scattered among short-lived ones fragment memory.

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

import bisect
import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ALIGN = 512  # bytes; allocations are rounded up to this, as CUDA's caching allocator does
# 25.7M parameters; at batch 8 its tensors are 0.5 to 16 MiB, the sizes torch's caching
# allocator sorts into its 2 MiB and 20 MiB segments.
FRAGMENTING_GPT = dict(seq_len=512, n_layer=8, n_head=8, d_model=512)


def _round(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class BestFit:
    """A fixed arena of ``capacity`` bytes; best-fit allocation, split and coalesce."""

    def __init__(self, capacity: int, base: int = 0):
        self.capacity = capacity
        self.free_blocks: list[tuple[int, int]] = [(base, capacity)] if capacity > 0 else []  # by offset
        self.used: dict[int, tuple[int, int]] = {}

    def alloc(self, uid: int, nbytes: int) -> bool:
        """Place ``uid``; False (out of memory) if no single free block is large enough."""
        size = _round(nbytes)
        fits = [i for i, (_, s) in enumerate(self.free_blocks) if s >= size]
        if not fits:
            return False
        i = min(fits, key=lambda j: self.free_blocks[j][1])  # the smallest block that fits
        offset, block = self.free_blocks.pop(i)
        if block > size:
            self.free_blocks.insert(i, (offset + size, block - size))  # split
        self.used[uid] = (offset, size)
        return True

    def free(self, uid: int) -> None:
        offset, size = self.used.pop(uid)
        i = bisect.bisect(self.free_blocks, (offset, size))
        self.free_blocks.insert(i, (offset, size))
        # Coalesce with the neighbours on both sides.
        if i + 1 < len(self.free_blocks) and offset + size == self.free_blocks[i + 1][0]:
            self.free_blocks[i] = (offset, size + self.free_blocks.pop(i + 1)[1])
        if i > 0 and self.free_blocks[i - 1][0] + self.free_blocks[i - 1][1] == offset:
            prev = self.free_blocks.pop(i - 1)
            self.free_blocks[i - 1] = (prev[0], prev[1] + self.free_blocks[i - 1][1])

    @property
    def free_bytes(self) -> int:
        return sum(s for _, s in self.free_blocks)

    @property
    def largest_free(self) -> int:
        return max((s for _, s in self.free_blocks), default=0)


class CachingArena:
    """Device memory as a caching allocator manages it: segments, each a :class:`BestFit`.

    Memory is reserved from the device in segments (2 MiB for requests up to 1 MiB,
    20 MiB for requests up to 10 MiB, larger ones rounded up to 2 MiB each: the
    defaults of torch's CUDA caching allocator) and kept for reuse. A request takes
    the best-fitting free block of any segment of its size class, splitting it;
    freed blocks merge only with free neighbours *in the same segment*. When no
    block fits and a new segment would pass ``capacity``, every segment with nothing
    allocated in it is given back (torch frees its cached blocks and retries) and
    the reservation tried again; if it still does not fit, the request fails,
    however much is free inside the segments still held: that is fragmentation.

    Args: ``capacity`` (bytes of device memory), ``reserved`` (bytes already taken,
    e.g. by MD's pools), ``scale`` (divides the size classes above; > 1 lets a small
    model's tensors meet them as a larger model's would).
    """

    def __init__(self, capacity: int, reserved: int = 0, scale: float = 1.0):
        self.capacity, self.reserved = capacity, reserved
        # scale > 1 shrinks the size classes in proportion, so a small model's tensors
        # meet them as a large model's tensors meet the real ones.
        self.SMALL, self.SMALL_SEGMENT = int(2**20 / scale), int(2 * 2**20 / scale)
        self.LARGE_SEGMENT, self.HUGE, self.ROUND = int(20 * 2**20 / scale), int(10 * 2**20 / scale), \
            max(ALIGN, int(2 * 2**20 / scale))
        self.segments: dict[bool, list[BestFit]] = {True: [], False: []}
        self.owner: dict[int, BestFit] = {}

    def alloc(self, uid: int, nbytes: int) -> bool:
        size, small = _round(nbytes), _round(nbytes) <= self.SMALL
        fitting = [(min(s for _, s in seg.free_blocks if s >= size), i)
                   for i, seg in enumerate(self.segments[small]) if seg.largest_free >= size]
        if fitting:
            seg = self.segments[small][min(fitting)[1]]
        else:
            seg_size = (self.SMALL_SEGMENT if small else
                        self.LARGE_SEGMENT if size < self.HUGE else -(-size // self.ROUND) * self.ROUND)
            if self.reserved + seg_size > self.capacity:
                self.release_free_segments()  # what torch does before it reports out of memory
            if self.reserved + seg_size > self.capacity:
                return False
            self.reserved += seg_size
            seg = BestFit(seg_size)
            self.segments[small].append(seg)
        self.owner[uid] = seg
        return seg.alloc(uid, size)

    def free(self, uid: int) -> None:
        self.owner.pop(uid).free(uid)

    def release_free_segments(self) -> int:
        """Give every segment with nothing allocated in it back to the device; returns bytes.

        A segment holding even one live block stays reserved, whatever is free around it.
        """
        released = 0
        for small, segs in self.segments.items():
            keep = [seg for seg in segs if seg.free_bytes < seg.capacity]
            released += sum(seg.capacity for seg in segs) - sum(seg.capacity for seg in keep)
            self.segments[small] = keep
        self.reserved -= released
        return released

    @property
    def used(self) -> dict[int, BestFit]:
        return self.owner

    @property
    def allocated(self) -> int:
        return sum(seg.capacity - seg.free_bytes for segs in self.segments.values() for seg in segs)


@dataclass
class Replay:
    """Outcome of replaying a trace: ``ok``, or where it ran out and how much was free then.

    ``reserved``: bytes the allocator held from the device (segments plus MD's pools)
    after each event replayed, up to the failure.
    """

    ok: bool
    capacity: int
    failed_event: int | None = None
    failed_bytes: int = 0
    free_bytes_at_failure: int = 0
    largest_free_at_failure: int = 0
    reserved: list[int] = field(default_factory=list)

    @property
    def free_fraction(self) -> float:
        """Share of the arena that was free when an allocation failed (0 if none failed)."""
        return self.free_bytes_at_failure / self.capacity if not self.ok else 0.0


def lifetime_classes(trace: list[tuple[str, int, int, str]]) -> dict[int, str]:
    """Each long-lived uid's class ``"born->died"``; short-lived uids are left out.

    A tensor freed in the phase that made it is short-lived. The others are the
    long-lived tensors of Sec 6.3, grouped by when they live: ``forward->backward``
    (activation checkpoints), ``backward->step`` or ``backward->end`` (parameter
    gradients), ``setup->end`` (model states that exist before the step).
    """
    born, died = {}, {}
    for event, uid, _, phase in trace:
        (born if event == "alloc" else died)[uid] = phase
    return {uid: f"{phase}->{died.get(uid, 'end')}" for uid, phase in born.items() if died.get(uid) != phase}


def pool_bytes(trace, members: set[int]) -> int:
    """Most bytes the ``members`` hold at once: the size of their MD pool."""
    live = peak = 0
    for event, uid, nbytes, _ in trace:
        if uid in members:
            live += _round(nbytes) if event == "alloc" else -_round(nbytes)
            peak = max(peak, live)
    return peak


def replay(trace, capacity: int, md: bool = False, scale: float = 1.0) -> Replay:
    """Run ``trace`` through a :class:`CachingArena` of ``capacity`` bytes.

    With ``md``, each class of long-lived tensors (:func:`lifetime_classes`: the
    activation checkpoints, the gradients, ...) goes to a contiguous pool of its own,
    reserved up front and as large as that class ever needs at once (Sec 6.3); only
    short-lived tensors go through the caching allocator's segments.
    """
    classes = lifetime_classes(trace) if md else {}
    pools = {name: BestFit(pool_bytes(trace, {u for u, c in classes.items() if c == name}))
             for name in sorted(set(classes.values()))}
    reserved = sum(pool.capacity for pool in pools.values())
    if reserved > capacity:
        return Replay(False, capacity, 0, reserved, capacity, capacity)
    cache = CachingArena(capacity, reserved=reserved, scale=scale)
    live, held = 0, []
    for i, (event, uid, nbytes, _) in enumerate(trace):
        arena = pools[classes[uid]] if uid in classes else cache
        if event == "free":
            if uid in arena.used:
                arena.free(uid)
                live -= _round(nbytes)
        elif arena.alloc(uid, nbytes):
            live += _round(nbytes)
        else:
            return Replay(False, capacity, i, nbytes, capacity - live, arena.largest_free
                          if isinstance(arena, BestFit) else 0, held)
        held.append(cache.reserved)
    return Replay(True, capacity, reserved=held)


def smallest_capacity(trace, md: bool, step: int = ALIGN, scale: float = 1.0) -> int:
    """The smallest arena (bytes, multiple of ``step``) in which ``trace`` replays without OOM."""
    live = peak = 0
    for event, _, nbytes, _ in trace:
        live += _round(nbytes) if event == "alloc" else -_round(nbytes)
        peak = max(peak, live)
    lo, hi = peak // step, 4 * peak // step + 1  # never less than the live peak
    while not replay(trace, hi * step, md, scale).ok:
        if hi * step > 64 * peak:  # a pool that fragments itself: no capacity helps
            raise ValueError(f"trace does not replay even in {hi * step} bytes (64 x its live peak)")
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if replay(trace, mid * step, md, scale).ok:
            hi = mid
        else:
            lo = mid + 1
    return hi * step


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
        for p, g in zip(params, flat_grads.split([p.numel() for p in params])):
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
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
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
