"""Exercise ``02.shard_range``'s check: flat padded shards (paper Sec 5.1).

Which elements of a flat buffer, padded with zeros to a multiple of Nd, a rank owns.
The trial asks every rank about buffers with and without a remainder on 2 and 3 ranks,
gathers the answers, and checks that they cover each element exactly once, in equal
contiguous shards in rank order, with the least padding that makes them equal.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch02.shard_range`.
"""

from __future__ import annotations

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch02.shard_range import shard_range
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register

SIZES = (23, 22, 24, 10, 1, 2, 3, 42_368)
"""Buffer sizes (Psi, elements) the trial asks about: with and without a remainder on 2 and 3 ranks."""


def _spans(elements: list[int], psi: int) -> str:
    """Sorted element indices as 'element 22 of the 23 is' / 'elements 21 to 22 of the 23 are'."""
    run_end = elements[0]
    while run_end + 1 in elements:
        run_end += 1
    if len(elements) == 1:
        return f"element {elements[0]} of the {psi} is"
    head = f"elements {elements[0]} to {run_end}" if run_end - elements[0] + 1 == len(elements) else \
        f"{len(elements)} elements, from {elements[0]},"
    return f"{head} of the {psi} are"


def _shard_trial(fn) -> str:
    """Every rank answers for its own rank; the answers, gathered, must cover each of the
    ``psi`` elements exactly once, in equal contiguous shards in rank order, with the least
    padding that makes them equal."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    for psi in SIZES:
        got = fn(psi, ws, rank)
        got = tuple(got) if isinstance(got, list) else got
        ok = isinstance(got, tuple) and len(got) == 3 and all(isinstance(v, int) for v in got)
        answers = comm.gather_objects(got if ok else None)
        if not ok:
            raise Wrong(f"shard_range({psi}, {ws}, {rank}) returned {got!r}; expected a tuple of three ints "
                        "(start, end, padding)")
        if None in answers:
            raise Wrong(f"rank {answers.index(None)} did not return a tuple of three ints for psi = {psi}")
        where = f"psi = {psi} on {ws} ranks, your shards are " + ", ".join(f"[{s}, {e})" for s, e, _ in answers)
        owners = {}
        for r, (s, e, _) in enumerate(answers):
            for i in range(max(s, 0), min(e, psi)):
                if i in owners:
                    raise Wrong(f"element {i} is owned by rank {owners[i]} and rank {r}: {where}")
                owners[i] = r
        orphans = [i for i in range(psi) if i not in owners]
        if orphans:
            raise Wrong(f"{_spans(orphans, psi)} owned by no rank: {where}; pad the buffer to a "
                        "multiple of world_size so that the last shard covers the remainder")
        sizes = [e - s for s, e, _ in answers]
        if len(set(sizes)) > 1:
            big = max(range(ws), key=lambda r: sizes[r])
            small = min(range(ws), key=lambda r: sizes[r])
            raise Wrong(f"rank {big}'s shard has {sizes[big]} elements, rank {small}'s {sizes[small]}: {where}; "
                        "shards must be equal (pad the buffer with zeros instead)")
        starts = [s for s, _, _ in answers]
        if starts != [r * sizes[0] for r in range(ws)]:
            raise Wrong(f"{where}; rank r's shard must start at r x {sizes[0]}, the r-th slice in rank order")
        want = -psi % ws
        pads = {p for _, _, p in answers}
        if pads != {want}:
            reason = (f"{psi} is already a multiple of {ws}" if want == 0 else
                      f"the next multiple of world_size is {psi + want}")
            raise Wrong(f"psi = {psi} on {ws} ranks: you pad {sorted(pads)[0]} elements; {reason}, so padding is "
                        f"{want}: pad only up to the next multiple of world_size")
        if answers[-1][1] != psi + want:
            raise Wrong(f"{where}; the last shard must end at the padded size {psi + want}")
    start, end, padding = fn(SIZES[0], ws, rank)
    return (f"shards of {', '.join(map(str, SIZES))} elements are equal, in rank order, and cover every element "
            f"once (Psi = {SIZES[0]} on {ws} ranks: padding {padding}, rank {rank} owns [{start}, {end}))")


_drop_remainder = edited(
    shard_range, {"padding = -psi % world_size": "padding = 0"}, name="_drop_remainder",
    doc="""psi // world_size per rank and no padding: the last psi % world_size elements get no
    owner (their optimizer state and update are silently lost).""")

_last_takes_rest = edited(
    shard_range, {"padding = -psi % world_size": "padding = 0",
                  "(rank + 1) * shard, padding": "psi if rank == world_size - 1 else (rank + 1) * shard, padding"},
    name="_last_takes_rest",
    doc="""torch.chunk / array_split style: the last rank takes the remainder, so shards differ
    and an equal-size reduce-scatter or all-gather cannot move them.""")

_always_pad = edited(
    shard_range, {"padding = -psi % world_size": "padding = world_size - psi % world_size"}, name="_always_pad",
    doc="""``world_size - psi % world_size`` zeros: a whole extra row of padding when psi already
    divides (an off-by-one of the ceil-to-multiple formula).""")


register(Exercise(
    "02.shard_range", "Flat padded shards: which elements each rank owns",
    shard_range, _shard_trial,
    {"drop_remainder": Bug(_drop_remainder, "per-rank size psi // Nd with no padding", "owned by no rank"),
     "last_takes_rest": Bug(_last_takes_rest, "torch.chunk-style splits", "shards must be equal"),
     "always_pad": Bug(_always_pad, "an off-by-one in padding to a multiple", "the next multiple")},
    stepped=False))
