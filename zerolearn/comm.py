"""The module that calls torch.distributed collectives (with its guard), and their ledger.

Every engine moves data through these four functions, so one ledger sees all
traffic: calls, elements, bytes and seconds per collective. The ``elements`` of a
call is its full logical tensor (docs/ARCHITECTURE.md, "The training run"): the input of a reduce_scatter,
the output of an all_gather, the tensor of an all_reduce or broadcast. With that
convention the paper's per-rank volume (Sec 7.1) is

    2 * all_reduce + reduce_scatter + all_gather (+ broadcast),

since a ring all-reduce is a reduce-scatter followed by an all-gather.

The same ledger books the collectives a reader calls by torch's own names
(``dist.all_reduce``, ``dist.reduce_scatter_single``, ...) inside
:func:`zerolearn.watch.watching`; calls made here are booked here only (:func:`booking`).

Under ``torch.profiler`` every call is also labelled (:func:`profiler_label`), so a
trace shows which collective the main thread launched or waited for, and for what
(:mod:`zerolearn.timeline` reads these labels back). Without a profiler running the
labels cost nothing.

Every call also goes through :mod:`zerolearn.guard`, which makes ranks that disagree
fail loudly instead of hanging: a fingerprint check in debug mode, and a message
naming dead or stuck ranks when a collective fails.

A fifth op, :func:`all_to_all` (ZeRO++'s quantized gradient exchange, qgZ: Wang et al.,
arXiv 2306.10209, Sec 3.3), is recorded too; its ``elements`` is its input. It is not a
term of the paper's volume (:meth:`CommLedger.volume_elements` keeps Sec 7.1's formula
over the four ops above); with ZeRO++ compare ``bytes``, since quantized calls move int8
or packed int4 values and fp32 scales.

**Intra- and inter-node bytes.** After :func:`set_nodes` (k ranks per "node": global
ranks ``[0, k)``, ``[k, 2k)``, ...), every call is also split by link, per rank, under this
model: a call on a group of p ranks whose counted tensor has B bytes exchanges a piece of
B / p bytes with each other rank of the group: an all_gather receives every other rank's
piece, a reduce_scatter or an all_to_all sends every other rank its piece, a ring
all_reduce counts as a reduce_scatter plus an all_gather (2 B / p per peer); a broadcast
brings B bytes from the source to every other rank (the source counts none). Bytes with
a peer in the same node are ``intra``, the others ``inter`` (:meth:`CommLedger.by_link`,
optionally for one kind of work, the ``doing`` of :func:`unit`). Without nodes set
(the default) none of this is computed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerolearn import compat, guard
from zerolearn.errors import require_count
from zerolearn.guard import CollectiveError, CollectiveMismatch, debug_enabled, set_debug, unit

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")  # the paper's (Sec 7.1)
EXTRA_OPS = ("all_to_all",)  # ZeRO++'s qgZ; recorded, not in the paper's volume
# Profiler labels: "<LAUNCH>|op|async or sync|unit|doing" around a call, "<WAIT>|op" around Handle.wait,
# "<RELEASE>|op" around the wait for gloo to let go of the tensors (inside either).
LAUNCH, WAIT, RELEASE = "zerolearn.comm", "zerolearn.wait", "zerolearn.release"
__all__ = ["EXTRA_OPS", "LAUNCH", "LEDGER", "OPS", "RELEASE", "WAIT", "CollectiveError", "CollectiveMismatch",
           "CommLedger", "Handle", "all_gather", "all_reduce", "all_to_all", "barrier", "booking", "broadcast",
           "debug_enabled",
           "gather_objects", "monitor_max", "monitor_mean", "node_ranks", "profiler_label", "reduce_scatter",
           "phase_group", "set_debug", "set_nodes", "unit"]


@dataclass
class OpStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommLedger:
    """Totals per collective for this process since the last :meth:`reset`."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    # The same totals split by purpose: "dp" (ZeRO-DP), "tp" (tensor parallelism), "pa" (P_a).
    tags: dict[str, dict[str, OpStats]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(OpStats)))

    def record(self, op: str, tensor: torch.Tensor, seconds: float, tag: str = "dp") -> None:
        self.book(op, tensor.numel(), tensor.element_size(), seconds, tag)

    def book(self, op: str, elements: int, element_size: int, seconds: float, tag: str = "dp") -> None:
        """Add one call of ``op`` that counted ``elements`` of ``element_size`` bytes each."""
        for s in (self.ops[op], self.tags[tag][op]):
            s.calls += 1
            s.elements += elements
            s.bytes += elements * element_size
            s.seconds += seconds

    # Bytes per link, per kind of work (guard.calling_unit()'s "doing"): {doing: {"intra": b, "inter": b}}.
    links: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: {"intra": 0, "inter": 0}))

    def reset(self) -> None:
        self.ops.clear()
        self.tags.clear()
        self.links.clear()

    def link(self, op: str, tensor: torch.Tensor, group, src: int | None = None) -> None:
        """Add one call's bytes to :attr:`links` under the module's model (:func:`set_nodes` first)."""
        nbytes = tensor.numel() * tensor.element_size()
        intra, inter, me, p = _peers(group)
        counts = self.links[guard.calling_unit()[1]]
        if op == "broadcast":
            if src is not None and src != me:
                counts["intra" if src // _nodes[0] == me // _nodes[0] else "inter"] += nbytes
            return
        piece = nbytes // p * (2 if op == "all_reduce" else 1)
        counts["intra"] += piece * intra
        counts["inter"] += piece * inter

    def by_link(self, doing: str | None = None) -> dict[str, int]:
        """``{"intra": bytes, "inter": bytes}`` this rank moved since :meth:`reset` with nodes set
        (:func:`set_nodes`; the model is in the module's docstring), for all work or only the
        collectives issued inside ``comm.unit(..., doing)`` (``"forward: gather"``, ...)."""
        picked = [v for d, v in self.links.items() if doing is None or d == doing]
        return {k: sum(v[k] for v in picked) for k in ("intra", "inter")}

    def by_tag(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{tag: {op: {calls, elements, bytes}}}`` for the tags seen since :meth:`reset`."""
        return {tag: {op: {"calls": s.calls, "elements": s.elements, "bytes": s.bytes} for op, s in ops.items()}
                for tag, ops in self.tags.items()}

    def volume_elements(self) -> int:
        """Paper's per-rank communication volume in elements (Sec 7.1)."""
        e = {op: self.ops[op].elements if op in self.ops else 0 for op in OPS}
        return 2 * e["all_reduce"] + e["reduce_scatter"] + e["all_gather"] + e["broadcast"]

    def as_dict(self) -> dict[str, dict[str, int]]:
        """The report's ``comm`` entry: ``{op: {calls, elements, bytes}}`` for all four ops
        (and ``all_to_all`` when it was called)."""
        out = {}
        for op in OPS + tuple(op for op in EXTRA_OPS if op in self.ops):
            s = self.ops.get(op, OpStats())
            out[op] = {"calls": s.calls, "elements": s.elements, "bytes": s.bytes}
        return out


LEDGER = CommLedger()
_booking: ContextVar[bool] = ContextVar("zerolearn_comm_booking", default=False)


def booking() -> bool:
    """Whether a call of this module is under way: :mod:`zerolearn.watch`, which books
    torch.distributed's collectives called by their own names, then leaves them to it."""
    return _booking.get()


@contextlib.contextmanager
def _own():
    token = _booking.set(True)
    try:
        yield
    finally:
        _booking.reset(token)
_nodes: list = [None]  # [k ranks per node or None, {group: (intra peers, inter peers, my rank, size)}]


def set_nodes(node_ranks: int | None) -> None:
    """Split the ledger's bytes by link from now on: nodes of ``node_ranks`` consecutive global
    ranks (None: one node, nothing split, nothing computed per call; the default).

    Raises:
        ConfigError: ``node_ranks`` is not None nor an integer >= 1.
    """
    if node_ranks is not None:
        require_count("node_ranks", node_ranks)
    _nodes[:] = [node_ranks] if node_ranks is None else [node_ranks, {}]


def node_ranks() -> int | None:
    """Ranks per node of :func:`set_nodes` (None: not set)."""
    return _nodes[0]


def _peers(group) -> tuple[int, int, int, int]:
    cached = _nodes[1].get(group)
    if cached is None:
        ranks, me, k = guard.group_ranks(group), dist.get_rank(), _nodes[0]
        intra = sum(1 for r in ranks if r != me and r // k == me // k)
        cached = _nodes[1][group] = (intra, len(ranks) - 1 - intra, me, len(ranks))
    return cached


# gloo runs a collective on a worker thread that lets go of the collective's tensors a
# moment *after* the caller's wait() returns. A tensor the caller then drops would be
# freed at a time that depends on thread scheduling, and a memory measurement taken
# just after it (the memory ledger's) would differ from run to run. So once a gloo
# collective has finished, these functions wait until the references to each tensor
# and its storage are back to what they were before the call. A caller may have made
# views of the tensor while an asynchronous collective ran (a view holds its base and
# its storage): after VIEW_GRACE seconds it is then enough that the counts fell by what
# the work held. RELEASE_TIMEOUT bounds it all.
VIEW_GRACE, RELEASE_TIMEOUT = 0.01, 0.2


def _use_counts(tensors, group=None, check_backend: bool = True) -> list | None:
    # Counted the same way every time: a Python reference count depends on the caller.
    if check_backend and dist.get_backend(group) != "gloo":
        return None
    counts = [compat.use_counts(t) for t in tensors]
    return None if None in counts else counts


def _released(count, before, relaxed, grace_over: bool) -> bool:
    if all(c <= n for c, n in zip(count, before, strict=True)):
        return True
    return relaxed is not None and grace_over and all(c <= n for c, n in zip(count, relaxed, strict=True))


def _await_release(tensors, before: list | None, relaxed: list | None = None, op: str = "-") -> None:
    if before is None:
        return
    with profiler_label(RELEASE, op):
        _poll_release(tensors, before, relaxed)


def _poll_release(tensors, before: list, relaxed: list | None) -> None:
    relaxed = relaxed or [None] * len(tensors)
    start = time.perf_counter()
    while True:
        waited = time.perf_counter() - start
        counts = _use_counts(tensors, check_backend=False)
        if waited > RELEASE_TIMEOUT or all(_released(c, b, r, waited > VIEW_GRACE)
                                           for c, b, r in zip(counts, before, relaxed, strict=True)):
            return
        time.sleep(1e-4)  # not 0: the worker thread needs the GIL to let go


def profiler_label(*fields: str):
    """``torch.profiler.record_function("|".join(fields))`` while a profiler records, else nothing.

    The labels this module sets (``LAUNCH`` or ``WAIT`` first, then the op and, for a
    launch, ``async``/``sync`` and the :func:`unit` label) cover the time the calling
    thread spends in a call: launching an asynchronous collective, or blocked in a
    synchronous one or in :meth:`Handle.wait`. The fields are joined only when a
    profiler records.
    """
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function("|".join(fields))
    return contextlib.nullcontext()


class Handle:
    """An in-flight collective; :meth:`wait` blocks and books the time waited."""

    def __init__(self, work, op: str, group=None, tensors=(), before=None, held=None):
        self._work, self._op, self._group = work, op, group
        self._seq = guard.current()
        # gloo: each tensor's reference count before the call, and how many the work took.
        self._tensors, self._before, self._held = tensors, before, held

    def wait(self) -> None:
        if self._work is None:
            return
        with profiler_label(WAIT, self._op):
            t0 = time.perf_counter()
            with _own(), guard.loud(self._op, self._group, self._seq):
                self._work.wait()
            LEDGER.ops[self._op].seconds += time.perf_counter() - t0
            counts = _use_counts(self._tensors, self._group) if self._held is not None else None
            self._work = None
            if counts is not None:
                # Python references are left out: a view makes C++ hold one, however many views.
                relaxed = [(now[0] + 1_000_000, *(c - h for c, h in zip(now[1:], took[1:], strict=True)))
                           for now, took in zip(counts, self._held, strict=True)]
                _await_release(self._tensors, self._before, relaxed, self._op)
        self._tensors = ()


def _run(op: str, counted: torch.Tensor, call, async_op: bool, group, tensors: tuple,
         detail: str | None = None, tag: str = "dp", src: int | None = None) -> Handle:
    with _own():
        return _booked(op, counted, call, async_op, group, tensors, detail, tag, src)


def _booked(op: str, counted: torch.Tensor, call, async_op: bool, group, tensors: tuple,
            detail: str | None, tag: str, src: int | None) -> Handle:
    shapes = tuple(tuple(t.shape) for t in tensors)
    guard.before(op if detail is None else f"{op}({detail})", shapes, counted.dtype, group)
    before = _use_counts(tensors, group)
    # A synchronous call's label covers everything up to the release of its tensors.
    with profiler_label(LAUNCH, op, "async" if async_op else "sync", *guard.calling_unit()):
        t0 = time.perf_counter()
        with guard.loud(op, group):
            work = call()
        LEDGER.record(op, counted, time.perf_counter() - t0, tag)
        if _nodes[0] is not None:
            LEDGER.link(op, counted, group, src)
        if not async_op:
            _await_release(tensors, before, op=op)
    if not async_op:
        return Handle(None, op, group)
    after = _use_counts(tensors, group)
    held = None if before is None else [tuple(a - b for a, b in zip(*pair, strict=True))
                                        for pair in zip(after, before, strict=True)]
    return Handle(work, op, group, tensors, before, held)


def monitor_mean(value: float, group=None) -> float:
    """Mean of a Python number over ranks, for logging (e.g. the global loss).

    Monitoring, not training: this traffic (one element) stays out of the ledger,
    which counts what the algorithm itself moves.
    """
    if dist.get_backend(group) == "fake":  # a simulated world: only rank 0 exists
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    guard.count()
    with _own(), guard.loud("monitor_mean", group), guard.monitoring("monitor_mean"):
        dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


class Monitor:
    """A bookkeeping collective in flight (:func:`monitor_max`); :meth:`wait` finishes it."""

    def __init__(self, work, op: str, group=None):
        self._work, self._op, self._group, self._seq = work, op, group, guard.current()

    def wait(self) -> None:
        if self._work is not None:
            with guard.loud(self._op, self._group, self._seq):
                self._work.wait()
            self._work = None


def monitor_max(tensor: torch.Tensor, group=None, async_op: bool = False) -> Monitor | None:
    """Elementwise max of ``tensor`` over ranks, in place: bookkeeping (which parameters
    any rank used), not in the ledger, which counts what the algorithm itself moves.

    Returns:
        with ``async_op``, a :class:`Monitor` to wait on before reading ``tensor``; else None.
    """
    guard.count()
    with _own(), guard.loud("monitor_max", group), guard.monitoring("monitor_max"):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op)
    return Monitor(work, "monitor_max", group) if async_op else None


_PHASE_GROUPS: dict[tuple[str, str], object] = {}  # (group name, phase) -> its twin of the same ranks


def phase_group(group, phase: str):
    """The process group for one phase's collectives (``phase``: ``"forward"`` or ``"backward"``):
    on gloo, a twin of ``group`` (the same ranks and timeout, made once per group and phase by
    ``dist.new_group(..., use_local_synchronization=True)``, so only ``group``'s ranks take part);
    ``group`` itself on any other backend, at world size 1, or in debug mode, whose agreement
    check names such a mistake before it happens.

    ZeRO-3 all-gathers in both forward and backward. A rank that skips a backward (a NaN loss
    on that rank alone) would issue its next forward's gathers where its peers issue the
    backward's, of other sizes, and gloo's transport thread ends the process (SIGABRT) at the
    first size that differs; on twins, each rank waits on a collective no peer joins and
    fails at the group's timeout with a CollectiveError naming it. Every rank issues each
    twin's collectives in the same order, so the schedule is unchanged.

    Raises:
        ValueError: ``phase`` not ``"forward"`` or ``"backward"``.
    """
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase {phase!r}: allowed are 'forward', 'backward'")
    if (dist.get_world_size(group) == 1 or dist.get_backend(group) != "gloo" or debug_enabled()):
        return group
    pg = group or dist.group.WORLD
    key = (dist.distributed_c10d._get_process_group_name(pg), phase)
    twin = _PHASE_GROUPS.get(key)
    if twin is None or twin not in dist.distributed_c10d._world.pg_map:  # none yet, or destroyed with its world
        timeout = pg._get_backend(torch.device("cpu")).options._timeout
        twin = dist.new_group(dist.get_process_group_ranks(pg), timeout=timeout, backend="gloo",
                              use_local_synchronization=True)
        _PHASE_GROUPS[key] = twin
    return twin


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (for reports; not in the ledger)."""
    out = [None] * dist.get_world_size(group)
    guard.count()
    with _own(), guard.loud("gather_objects", group), guard.monitoring("gather_objects", 2):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` gets here (not in the ledger)."""
    if dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake":
        guard.count()
        with _own(), guard.loud("barrier", group), guard.monitoring("barrier"):
            dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False,
               tag: str = "dp") -> Handle:
    """Sum (or ``op``) ``tensor`` over the ranks of ``group``, in place."""
    return _run("all_reduce", tensor,
                lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op,
                group, (tensor,), tag=tag)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                   overwrite_input: bool = False) -> Handle:
    """``output`` (n elements) = this rank's chunk of the sum of ``input`` (n * world_size).

    ``overwrite_input``: the caller is done with ``input`` (a gradient bucket about to
    be freed). gloo's reduce_scatter clones the whole input, all-reduces the clone and
    copies this rank's chunk out; with this flag the all-reduce runs on ``input`` itself,
    which then holds the sum (:class:`_ChunkOfAllReduce`): the same sums, bit for bit,
    without the clone (a bucket-sized allocation and copy per call). Other backends
    ignore it.
    """
    if overwrite_input and input.is_contiguous() and dist.get_backend(group) == "gloo":
        call = functools.partial(_ChunkOfAllReduce.launch, output, input, group, async_op)
    else:
        call = functools.partial(dist.reduce_scatter_single, output, input, group=group, async_op=async_op)
    return _run("reduce_scatter", input, call, async_op, group, (input, output))


class _ChunkOfAllReduce:
    """gloo's reduce_scatter without its clone: all_reduce ``input`` in place, then copy
    this rank's chunk into ``output`` once the sum is there (:meth:`wait`)."""

    def __init__(self, work, output: torch.Tensor, chunk: torch.Tensor):
        self.work, self.output, self.chunk = work, output, chunk

    @classmethod
    def launch(cls, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
        n = output.numel()
        start = dist.get_rank(group) * n
        pending = cls(dist.all_reduce(input, group=group, async_op=async_op), output,
                      input.view(-1)[start:start + n])
        if async_op:
            return pending
        pending.wait()
        return None

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        if self.chunk is not None:
            self.output.copy_(self.chunk.view_as(self.output))
        self.work = self.output = self.chunk = None  # let go of the tensors, as gloo's work does
        return True


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               tag: str = "dp") -> Handle:
    """``output`` (n * world_size elements) = every rank's ``input`` (n), in rank order."""
    return _run("all_gather", output,
                lambda: dist.all_gather_single(output, input, group=group, async_op=async_op),
                async_op, group, (input, output), tag=tag)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, tag: str = "dp") -> Handle:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
    return _run("broadcast", tensor,
                lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op,
                group, (tensor,), detail=f"src={src}", tag=tag, src=src)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               tag: str = "dp") -> Handle:
    """``output`` (n elements) = piece r of every rank's ``input`` (n), in rank order, where
    piece r (n / world_size elements) of a rank's ``input`` goes to group rank r.
    n must be a multiple of the group's size. Recorded as ``all_to_all`` (elements: the input)."""
    return _run("all_to_all", input,
                lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op),
                async_op, group, (input, output), tag=tag)
