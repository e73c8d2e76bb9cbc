"""One rank's step as intervals, read from a ``torch.profiler`` recording; overlap measured on them.

An interval is a dict ``{"rank", "lane", "label", "start", "end"}``, times in seconds
from the start of the recorded step on that rank (the ``step`` interval starts at 0).
The lanes:

* ``step``: the whole step on the main thread, label ``step``.
* ``compute``: a phase of the step on the main thread, label ``forward``, ``backward``
  or ``step`` (the optimizer step and ``zero_grad``). A phase interval includes the
  time the main thread spent inside it launching and waiting for collectives.
* ``comm``: one collective, from the moment the main thread launched it to the moment
  it completed, label its op (``all_reduce``, ``reduce_scatter``, ``all_gather``,
  ``broadcast``). Extra keys: ``unit`` and ``doing`` (the :func:`zerolearn.comm.unit`
  label, e.g. ``bucket[...]`` / ``backward: reduce``), ``phase`` (the phase it was
  launched in), ``sync`` (a blocking call) and ``backend`` (the backend's own event).
  For a reduce_scatter that is ``gloo:all_reduce``: gloo clones the whole input while
  launching, all-reduces the clone and copies this rank's chunk out when waited for
  (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so on gloo it costs the
  time of an all-reduce, and the clone and the copy show as launch and wait.
* ``launch``: the main thread inside an asynchronous call, enqueueing it (label op).
* ``wait``: the main thread blocked on communication (label op, key ``phase``): in
  :meth:`zerolearn.comm.Handle.wait`, or in a synchronous collective. Key ``release``:
  the seconds of it spent after the collective had finished, until gloo's worker
  thread let go of the tensors (:mod:`zerolearn.comm` waits for that so that memory
  measurements do not depend on thread scheduling).

gloo runs each collective on a worker thread of its own, so an asynchronous
collective's ``comm`` interval runs alongside the main thread's compute; the
completion time is the end of gloo's ``gloo:<op>`` profiler event, which the worker
thread closes. (On GPUs NCCL's kernels would have to be read from the CUDA stream
instead; this module reads gloo's events.)

Overlap (paper Sec 5.2 buckets, Sec 5.3 prefetch; Sec 7 prices the volume, this shows
the time): for one rank,

    C = union of the ``comm`` intervals (optionally: launched in one phase, of some ops)
    K = union of the ``compute`` intervals (that phase) minus the union of the
        ``wait`` and ``launch`` intervals: the main thread computing
    overlap = |C intersect K| / |C|      (0 when C is empty)

so ``overlap`` is the fraction of communication time hidden behind compute, and
``|C| - |C intersect K|`` is the exposed communication time. Lengths are in seconds;
``wait_s`` is the length of the union of the ``wait`` intervals, ``release_s`` the
part of it spent waiting for gloo to release tensors. On CPU the hidden
communication still takes a core from compute (gloo's thread runs beside it), so
hidden is not free here the way it is with a GPU's copy engines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from zerolearn import comm, guard

STEP, PHASE = "zerolearn.step", "zerolearn.phase"  # profiler labels set by zerolearn.timeline.runs
LANES = ("step", "compute", "comm", "launch", "wait")
__all__ = ["LANES", "PHASE", "STEP", "calls", "intervals_from_events", "length", "overlap", "profile_events",
           "subtract", "intersect", "union"]

Span = tuple[float, float]


# ----- interval arithmetic on (start, end) pairs, seconds ------------------------------
def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering exactly the points of ``spans``."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(spans: Iterable[Span]) -> float:
    """Total length of the union of ``spans`` (overlaps counted once)."""
    return sum(b - a for a, b in union(spans))


def intersect(x: Iterable[Span], y: Iterable[Span]) -> list[Span]:
    """Union of the points in both ``x`` and ``y``."""
    x, y = union(x), union(y)
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Iterable[Span], y: Iterable[Span]) -> list[Span]:
    """Union of the points of ``x`` not in ``y``."""
    out, y = [], union(y)
    for a, b in union(x):
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def _spans(intervals: list[dict], lane: str, rank: int, keep=lambda i: True) -> list[Span]:
    return [(i["start"], i["end"]) for i in intervals if i["lane"] == lane and i["rank"] == rank and keep(i)]


def overlap(intervals: list[dict], rank: int, phase: str | None = None,
            ops: tuple[str, ...] | None = None) -> dict:
    """How much of ``rank``'s communication ran hidden behind its compute (module docstring).

    Args:
        intervals: as recorded (any ranks; only ``rank``'s are read).
        phase: only collectives launched in this phase (``"forward"``, ``"backward"``,
            ``"step"``), against the compute of this phase; None: the whole step.
        ops: only these collectives (and waits for them); None: all.

    Returns:
        ``comm_s`` |C|, ``hidden_s`` |C and K|, ``exposed_s`` |C| - |C and K|,
        ``overlap`` |C and K| / |C| (0.0 when nothing was communicated), ``wait_s``
        (main thread blocked on those collectives) and ``release_s`` (the part of it
        after they had finished), ``compute_s`` |K|, ``calls`` (the number of
        collectives counted); seconds except ``overlap`` and ``calls``.
    """
    def mine(i: dict) -> bool:
        return (phase is None or i.get("phase") == phase) and (ops is None or i["label"] in ops)

    c = union(_spans(intervals, "comm", rank, mine))
    busy = _spans(intervals, "wait", rank) + _spans(intervals, "launch", rank)
    k = subtract(_spans(intervals, "compute", rank, lambda i: phase is None or i["label"] == phase), busy)
    hidden, comm_s = length(intersect(c, k)), length(c)
    waits = [i for i in intervals if i["lane"] == "wait" and i["rank"] == rank and mine(i)]
    return {"comm_s": comm_s, "hidden_s": hidden, "exposed_s": comm_s - hidden,
            "overlap": hidden / comm_s if comm_s > 0 else 0.0,
            "wait_s": length((i["start"], i["end"]) for i in waits),
            "release_s": sum(i.get("release", 0.0) for i in waits), "compute_s": length(k),
            "calls": sum(1 for i in intervals if i["lane"] == "comm" and i["rank"] == rank and mine(i))}


def calls(intervals: list[dict], rank: int) -> dict[str, int]:
    """Collectives per op on ``rank``, as the ledger counts them (``{op: calls}``, every op of comm.OPS)."""
    seen = Counter(i["label"] for i in intervals if i["lane"] == "comm" and i["rank"] == rank)
    return {op: seen.get(op, 0) for op in comm.OPS}


# ----- from the profiler's events ---------------------------------------------------------
def profile_events(prof) -> list[tuple[str, int, float, float]]:
    """The events of a finished ``torch.profiler.profile`` this module reads, as
    ``(name, thread, start_us, end_us)``: zerolearn's labels and the backend's collectives."""
    wanted = (STEP, PHASE, comm.LAUNCH, comm.WAIT, comm.RELEASE, guard.MONITOR, "gloo:")
    return [(e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.name.startswith(wanted)]


def _algorithm_events(inside: list[tuple[str, int, float, float]]) -> list[tuple[str, int, float, float]]:
    """The backend's events of the collectives launched through comm's ledger, in issue order.

    gloo's worker threads open an event per collective in the order they were issued.
    Monitoring collectives (not the algorithm's traffic and not in the ledger: ZeRO-3's
    unit agreement, the used-parameter flags) are labelled ``MONITOR|op|n`` where they
    are launched, n their backend collectives: walking launches and monitors in issue
    order, those n events are skipped.
    """
    backend = [e for e in inside if e[0].startswith("gloo:") and e[0] != "gloo:barrier"]
    issued = sorted((e for e in inside if e[0].startswith((comm.LAUNCH + "|", guard.MONITOR + "|"))),
                    key=lambda e: e[2])
    kept, i = [], 0
    for name, *_ in issued:
        n = int(name.split("|")[2]) if name.startswith(guard.MONITOR + "|") else 1
        if not name.startswith(guard.MONITOR + "|"):
            kept += backend[i:i + n]
        i += n
    return kept + backend[i:]  # more events than launches: the caller says so


def _containing(spans: list[tuple[float, float, str]], t: float) -> str | None:
    return next((name for a, b, name in spans if a <= t <= b), None)


def intervals_from_events(events: Iterable[tuple[str, int, float, float]], rank: int) -> list[dict]:
    """Intervals (module docstring) of the one step labelled ``STEP`` in ``events``.

    Args:
        events: ``(name, thread, start_us, end_us)`` as from :func:`profile_events`,
            microseconds on one clock; events outside the step are ignored (a barrier
            before it, say).
        rank: written into every interval.

    Raises:
        ValueError: no step label, or not one backend event per collective launched.
    """
    events = sorted(events, key=lambda e: e[2])
    steps = [e for e in events if e[0] == STEP]
    if len(steps) != 1:
        raise ValueError(f"expected one {STEP!r} event, found {len(steps)}")
    _, main, t0, t1 = steps[0]
    inside = [e for e in events if t0 <= e[2] <= t1 and e[0] != STEP]

    def sec(us: float) -> float:
        return round((us - t0) * 1e-6, 6)  # the profiler's clock ticks in microseconds

    out = [{"rank": rank, "lane": "step", "label": "step", "start": 0.0, "end": sec(t1)}]
    phases = [(a, b, name.split("|")[1]) for name, thread, a, b in inside if name.startswith(PHASE + "|")
              and thread == main]
    out += [{"rank": rank, "lane": "compute", "label": p, "start": sec(a), "end": sec(b)} for a, b, p in phases]
    launches = [e for e in inside if e[0].startswith(comm.LAUNCH + "|")]
    backend = _algorithm_events(inside)
    if len(backend) != len(launches):
        raise ValueError(f"{len(launches)} collectives launched but the profiler recorded {len(backend)} backend "
                         f"events ({sorted(set(e[0] for e in backend))}): the timeline reads gloo's events")
    releases = [(a, b) for name, _, a, b in inside if name.startswith(comm.RELEASE + "|")]

    def wait(op: str, a: float, b: float) -> dict:
        held = sum(d - c for c, d in releases if a <= c <= b)
        return {"rank": rank, "lane": "wait", "label": op, "start": sec(a), "end": sec(b),
                "phase": _containing(phases, a), "release": round(held * 1e-6, 6)}

    # gloo opens its event while the call enqueues the work, on the calling thread:
    # both lists are in issue order.
    for (name, _, a, b), (gloo, _, _, done) in zip(launches, backend, strict=True):
        _, op, mode, unit, doing = name.split("|")
        phase = _containing(phases, a)
        out.append({"rank": rank, "lane": "comm", "label": op, "start": sec(a), "end": sec(max(b, done)),
                    "unit": unit, "doing": doing, "phase": phase, "sync": mode == "sync", "backend": gloo})
        out.append(wait(op, a, b) if mode == "sync" else
                   {"rank": rank, "lane": "launch", "label": op, "start": sec(a), "end": sec(b), "phase": phase})
    out += [wait(name.split("|")[1], a, b) for name, _, a, b in inside if name.startswith(comm.WAIT + "|")]
    return out
