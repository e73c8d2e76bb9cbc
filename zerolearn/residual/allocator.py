"""A model of torch's caching allocator, to replay allocation traces (paper Sec 6.3).

Device memory is reserved in segments; inside a segment, best fit with block
splitting, and free blocks merge only with their neighbours in the same segment;
before an allocation is refused, every segment with nothing left in it is given back
(:class:`CachingArena`). A segment that still holds one live block stays reserved,
however much of it is free: that is how long-lived tensors scattered among
short-lived ones fragment memory. :func:`replay` runs a trace (from
:func:`zerolearn.residual.defrag.record_gpt_steps`) through it, as it happened or with
MD's pools; :func:`smallest_capacity` finds the smallest arena that works.

Units: bytes; every request is rounded up to :data:`ALIGN`. Runs anywhere, no GPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["ALIGN", "BestFit", "CachingArena", "Replay", "lifetime_classes", "pool_bytes", "replay",
           "smallest_capacity"]

ALIGN = 512  # bytes; allocations are rounded up to this, as CUDA's caching allocator does


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
