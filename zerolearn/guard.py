"""Ranks that disagree fail loudly: collective fingerprints and failure reports.

Collectives pair up by the order in which ranks issue them, so a rank that takes
another code path (skips a layer, runs an extra step) does not fail where it went
wrong: it hangs, or silently reduces the wrong tensors. :mod:`zerolearn.comm` runs
every call through two guards defined here:

* Debug mode (:func:`set_debug`, ``--debug-collectives``, or the environment variable
  ``ZEROLEARN_DEBUG_COLLECTIVES=1``): before each collective, the ranks exchange a
  fingerprint (operation, shapes, dtype, calling unit) with ``all_gather_object`` and
  raise :class:`CollectiveMismatch`, naming every rank and what it was about to do, at
  the first disagreement. It costs one extra round trip per collective, so it is off
  by default; its traffic stays out of the ledger (it is not the algorithm's).
* Always (gloo): when a collective fails (the process-group timeout for a stuck peer,
  a closed connection for a dead one), the rank posts what it was doing to the
  process group's key-value store, waits ``REPORT_GRACE_S`` seconds (env
  ``ZEROLEARN_REPORT_GRACE``, default 3) for the others'
  posts and raises :class:`CollectiveError` naming the ranks that stayed silent (dead
  or stuck) and what the others were doing. (NCCL reports failures from its watchdog
  thread, which aborts the process before Python sees them.)

Ranks that must agree on what they do next before doing it (ZeRO-3: which unit
runs) exchange one integer each with :func:`propose`, a fixed-size gather that pairs
up whatever they propose.

The "calling unit" is the label set with :func:`unit` around the collective
(``with comm.unit("blocks.1", "forward: gather"):``). The engines label their own
collectives: a ZeRO-3 unit's hooks with the unit's name (the unit whose hook is
running, which for a prefetch is not the unit being gathered), a bucket's reduction
and publication with its bucket (``bucket[first..last]``). Nothing is read off the
call stack: the label is passed explicitly, so it means the same in every Python.

This module and :mod:`zerolearn.comm` are the only ones that call torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import time
from contextvars import ContextVar

import torch
import torch.distributed as dist

from zerolearn import compat  # noqa: F401 - torch 2.13's collective names on torch 2.11


class CollectiveMismatch(RuntimeError):
    """Debug mode: ranks were about to run different collectives (would hang or mix data)."""


class CollectiveError(RuntimeError):
    """A collective failed (timeout, dead peer); the message names the silent ranks."""


DEBUG_ENV = "ZEROLEARN_DEBUG_COLLECTIVES"
REPORT_GRACE_S = float(os.environ.get("ZEROLEARN_REPORT_GRACE", "3"))  # wait for peers' posts, s
_debug = False
_seq = 0  # collectives issued through comm in this process (the same on every rank)
checks = 0  # fingerprint exchanges made (debug mode)
_label: ContextVar[tuple[str, str] | None] = ContextVar("zerolearn_unit", default=None)  # (unit, doing)


def set_debug(on: bool = True) -> None:
    """Turn debug mode (a fingerprint check before every collective) on or off."""
    global _debug
    _debug = on


def debug_enabled() -> bool:
    """True when :func:`set_debug` or ``ZEROLEARN_DEBUG_COLLECTIVES`` (not 0) asks for it."""
    return _debug or os.environ.get(DEBUG_ENV, "0") not in ("", "0")


@contextlib.contextmanager
def unit(name: str, doing: str = "-"):
    """Collectives issued inside this block are attributed to unit ``name`` in debug mode.

    Args:
        name: the unit or buffer the collectives serve (``"blocks.1"``, ``"bucket[a..b]"``).
        doing: what the caller is doing (``"forward: gather"``), shown in messages.

    An enclosing block's label wins over the ones inside it, so wrapping a call
    (``with comm.unit("probe"): engine.backward(loss)``) labels everything it issues,
    the engine's own labelled collectives included. Labels follow the thread (and
    asyncio task) that sets them, as a ``ContextVar``.
    """
    if _label.get() is not None:
        yield
        return
    token = _label.set((name, doing))
    try:
        yield
    finally:
        _label.reset(token)


def calling_unit() -> tuple[str, str]:
    """(unit, what it is doing) of the outermost :func:`unit` block around this call
    (the one that wins); ``("-", "-")`` outside every block."""
    return _label.get() or ("-", "-")


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` (None: the default group), in group-rank order."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def before(op: str, shapes: tuple, dtype: torch.dtype, group) -> None:
    """Count a collective about to be issued; in debug mode, check every rank agrees.

    Args:
        op: the collective's name (with any detail that must agree, e.g. the source).
        shapes: the tensors' shapes, input first.

    Raises:
        CollectiveMismatch: some rank's (op, shapes, dtype, unit) differs; the message
            lists every rank's.
    """
    global _seq, checks
    _seq += 1
    if not debug_enabled() or dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    where, doing = calling_unit()
    mine = {"fingerprint": (op, shapes, str(dtype).removeprefix("torch."), where), "doing": doing}
    everyone = [None] * dist.get_world_size(group)
    checks += 1
    with loud("fingerprint exchange", group), monitoring("fingerprint exchange", 2):
        dist.all_gather_object(everyone, mine, group=group)
    if all(e["fingerprint"] == mine["fingerprint"] for e in everyone):
        return
    lines = []
    for r, e in zip(group_ranks(group), everyone, strict=True):
        o, s, d, w = e["fingerprint"]
        lines.append(f"  rank {r}: {o} {d} {' -> '.join(str(list(x)) for x in s)} "
                     f"from unit {w} (in {e['doing']})")
    raise CollectiveMismatch(f"collective #{_seq}: ranks disagree on what to run next "
                             "(debug mode stopped it before it could hang or mix data):\n" + "\n".join(lines))


class Proposal:
    """Every rank's integer, gathered asynchronously (:func:`propose`); :meth:`result`
    waits for it."""

    def __init__(self, values: list[int] | None, work=None, everyone: torch.Tensor | None = None, group=None):
        self._values, self._work, self._everyone, self._group = values, work, everyone, group

    def result(self) -> list[int]:
        """Every rank's value, in group-rank order."""
        if self._values is None:
            with loud("propose", self._group):
                self._work.wait()
            self._values = self._everyone.tolist()
        return self._values


def propose(value: int, group=None, device: torch.device | str = "cpu") -> Proposal:
    """Start gathering every rank's integer ``value``: one all_gather of an int64.

    For ranks that must agree on what they do next *before* they do it (ZeRO-3: which
    unit to run), so that a rank on another code path is named at once instead of
    pairing with a collective of another size. The gather has the same size on every
    rank, so it pairs up whatever the ranks propose; check :meth:`Proposal.result`
    before issuing anything that depends on agreement. Eight bytes per rank, outside
    the ledger (bookkeeping, not the algorithm's traffic); counted in the numbering.
    """
    n = dist.get_world_size(group)
    if n == 1 or dist.get_backend(group) == "fake":
        return Proposal([value])
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    everyone = torch.empty(n, dtype=torch.int64, device=device)
    count()
    with loud("propose", group), monitoring("propose"):
        work = dist.all_gather_single(everyone, mine, group=group, async_op=True)
    return Proposal(None, work, everyone, group)


def count() -> None:
    """Count a monitoring collective (no fingerprint), so numbering stays aligned."""
    global _seq
    _seq += 1


def current() -> int:
    """Number of the latest collective issued through comm in this process."""
    return _seq


def _diagnose(op: str, group, seq: int | None, error: BaseException) -> str:
    """Post what this rank was doing, collect the others' posts, name the silent ranks."""
    me, ranks = dist.get_rank(), group_ranks(group)
    doing = f"{op} #{_seq if seq is None else seq}"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    head = f"rank {me}: {doing} failed ({first})"
    # One namespace per torchrun attempt: restarts may share the store with the failed one.
    key = ("zerolearn/failed/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/{}").format
    from zerolearn.dist import store as process_group_store

    store = process_group_store()
    if store is None:
        return f"{head}; could not ask the other ranks (the process group was not made by zerolearn.dist.init)"
    try:
        store.set(key(me), doing)
        heard, deadline = {me: doing}, time.monotonic() + REPORT_GRACE_S
        while len(heard) < len(ranks) and time.monotonic() < deadline:
            for r in ranks:
                if r not in heard and store.check([key(r)]):
                    heard[r] = store.get(key(r)).decode()
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - the store may have died with a peer
        return f"{head}; could not ask the other ranks ({type(e).__name__}: {e})"
    silent = [r for r in ranks if r not in heard]
    parts = [head]
    if silent:
        parts.append(f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} posted nothing within "
                     f"{REPORT_GRACE_S:g} s: dead or stuck")
    parts += [f"rank {r} failed in {d}" for r, d in sorted(heard.items()) if r != me]
    if not debug_enabled():  # the checks that would have named a rank on another code path first
        parts.append(f"if the ranks took different code paths, {DEBUG_ENV}=1 (debug mode) compares every "
                     "collective, and ZeRO-3's units, before running it and names the rank that differs")
    return "; ".join(parts)


# Profiler label around the launch of a monitoring collective (not in the ledger: a
# unit agreement, the used-parameter flags, a logged loss): "<MONITOR>|op|n", n the
# backend collectives it issues. The timeline leaves those out of the step's traffic.
MONITOR = "zerolearn.monitor"


def monitoring(op: str, backend_calls: int = 1):
    """``torch.profiler.record_function(f"{MONITOR}|{op}|{backend_calls}")`` while a
    profiler records, else nothing. ``backend_calls``: collectives the launch issues
    in the backend (``all_gather_object``: 2, the sizes and then the data)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"{MONITOR}|{op}|{backend_calls}")
    return contextlib.nullcontext()


@contextlib.contextmanager
def loud(op: str, group=None, seq: int | None = None):
    """Turn a gloo failure inside this block into a :class:`CollectiveError` naming ranks.

    ``seq``: the number of the collective that failed (default: the latest issued).
    """
    try:
        yield
    except (CollectiveError, CollectiveMismatch):
        raise
    except RuntimeError as e:  # gloo: timeouts and closed connections
        if not dist.is_initialized() or dist.get_backend(group) != "gloo":
            raise
        raise CollectiveError(_diagnose(op, group, seq, e)) from e
