"""The module that calls torch.distributed collectives (with its guard), and their ledger.

Every engine moves data through these four functions, so one ledger sees all
traffic: calls, elements, bytes and seconds per collective. The ``elements`` of a
call is its full logical tensor (DESIGN section 4): the input of a reduce_scatter,
the output of an all_gather, the tensor of an all_reduce or broadcast. With that
convention the paper's per-rank volume (Sec 7.1) is

    2 * all_reduce + reduce_scatter + all_gather (+ broadcast),

since a ring all-reduce is a reduce-scatter followed by an all-gather.

Every call also goes through :mod:`zerolearn.guard`, which makes ranks that disagree
fail loudly instead of hanging: a fingerprint check in debug mode, and a message
naming dead or stuck ranks when a collective fails.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerolearn import compat, guard
from zerolearn.guard import CollectiveError, CollectiveMismatch, debug_enabled, set_debug, unit

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
__all__ = ["LEDGER", "OPS", "CollectiveError", "CollectiveMismatch", "CommLedger", "Handle", "all_gather",
           "all_reduce", "barrier", "broadcast", "debug_enabled", "gather_objects", "monitor_mean",
           "reduce_scatter", "set_debug", "unit"]


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
        for s in (self.ops[op], self.tags[tag][op]):
            s.calls += 1
            s.elements += tensor.numel()
            s.bytes += tensor.numel() * tensor.element_size()
            s.seconds += seconds

    def reset(self) -> None:
        self.ops.clear()
        self.tags.clear()

    def by_tag(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{tag: {op: {calls, elements, bytes}}}`` for the tags seen since :meth:`reset`."""
        return {tag: {op: {"calls": s.calls, "elements": s.elements, "bytes": s.bytes} for op, s in ops.items()}
                for tag, ops in self.tags.items()}

    def volume_elements(self) -> int:
        """Paper's per-rank communication volume in elements (Sec 7.1)."""
        e = {op: self.ops[op].elements if op in self.ops else 0 for op in OPS}
        return 2 * e["all_reduce"] + e["reduce_scatter"] + e["all_gather"] + e["broadcast"]

    def as_dict(self) -> dict[str, dict[str, int]]:
        """The report's ``comm`` entry: ``{op: {calls, elements, bytes}}`` for all four ops."""
        out = {}
        for op in OPS:
            s = self.ops.get(op, OpStats())
            out[op] = {"calls": s.calls, "elements": s.elements, "bytes": s.bytes}
        return out

    def seconds(self) -> float:
        return sum(s.seconds for s in self.ops.values())


LEDGER = CommLedger()


class Handle:
    """An in-flight collective; :meth:`wait` blocks and books the time waited."""

    def __init__(self, work, op: str, group=None):
        self._work, self._op, self._group = work, op, group
        self._seq = guard.current()

    def wait(self) -> None:
        if self._work is None:
            return
        t0 = time.perf_counter()
        with guard.loud(self._op, self._group, self._seq):
            self._work.wait()
        LEDGER.ops[self._op].seconds += time.perf_counter() - t0
        self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _run(op: str, counted: torch.Tensor, call, async_op: bool, group, shapes: tuple,
         detail: str | None = None, tag: str = "dp") -> Handle:
    guard.before(op if detail is None else f"{op}({detail})", shapes, counted.dtype, group)
    t0 = time.perf_counter()
    with guard.loud(op, group):
        work = call()
    LEDGER.record(op, counted, time.perf_counter() - t0, tag)
    return Handle(work if async_op else None, op, group)


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
    with guard.loud("monitor_mean", group):
        dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (for reports; not in the ledger)."""
    out = [None] * dist.get_world_size(group)
    guard.count()
    with guard.loud("gather_objects", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` gets here (not in the ledger)."""
    if dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake":
        guard.count()
        with guard.loud("barrier", group):
            dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False,
               tag: str = "dp") -> Handle:
    """Sum (or ``op``) ``tensor`` over the ranks of ``group``, in place."""
    return _run("all_reduce", tensor,
                lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op,
                group, (tuple(tensor.shape),), tag=tag)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False) -> Handle:
    """``output`` (n elements) = this rank's chunk of the sum of ``input`` (n * world_size)."""
    return _run("reduce_scatter", input,
                lambda: compat.reduce_scatter_tensor(output, input, group=group, async_op=async_op),
                async_op, group, (tuple(input.shape), tuple(output.shape)))


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               tag: str = "dp") -> Handle:
    """``output`` (n * world_size elements) = every rank's ``input`` (n), in rank order."""
    return _run("all_gather", output,
                lambda: compat.all_gather_into_tensor(output, input, group=group, async_op=async_op),
                async_op, group, (tuple(input.shape), tuple(output.shape)), tag=tag)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, tag: str = "dp") -> Handle:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
    return _run("broadcast", tensor,
                lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op,
                group, (tuple(tensor.shape),), detail=f"src={src}", tag=tag)
