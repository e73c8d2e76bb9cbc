"""The kernel side of :mod:`zerolearn.live`: :class:`Ranks`, a pool of persistent ranks.

``Ranks`` spawns the rank processes (:mod:`zerolearn.live.rank`), sends each call to
every rank, and collects what comes back by a deadline: output labelled by rank
(:class:`Outputs`), results, or failures raised as one :class:`CellError`. A hang or a
dead rank kills and restarts them all.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import pickle
import time
import weakref
from multiprocessing.connection import wait

import cloudpickle

from zerolearn.dist import RankError, check_world, host_store, hosted_store_env
from zerolearn.errors import require_choice, require_count, require_real
from zerolearn.live.rank import _call, _exec, _pull, _push, _serve

START_TIMEOUT_S = 120.0  # spawning N processes that each import torch: seconds, more on a busy laptop
GRACE_S = 3.0  # once a rank has failed, how long the others may still take (they may wait for it)
WAKE_S = 0.2  # the longest a wait for the ranks goes without looking for a pending Ctrl-C

_POOLS: weakref.WeakSet = weakref.WeakSet()  # every live Ranks, for the atexit hook in zerolearn.live.magic


class CellError(RuntimeError):
    """Some ranks raised or did not finish a call of :class:`Ranks`.

    ``outputs`` holds what every rank printed (by rank), ``failed`` each failing rank's
    short traceback, ``unfinished`` the ranks killed at the deadline (the pool was then
    restarted, so ``restarted`` is True and every variable is gone).
    """

    def __init__(self, message: str, outputs: Outputs, failed: dict[int, str], unfinished: list[int],
                 restarted: bool):
        super().__init__(message)
        self.outputs, self.failed, self.unfinished, self.restarted = outputs, failed, unfinished, restarted

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through this module's frames.
        return str(self).splitlines()


class Outputs(list):
    """What each rank printed, by rank (``str``); shown with every line labelled ``[rank r]``."""

    def __repr__(self) -> str:
        return "\n".join(f"[rank {r}] {line}" for r, text in enumerate(self) for line in text.splitlines())


def _validate(world_size: int, backend: str, timeout_s: float) -> None:
    require_count("world_size", world_size)
    require_choice("backend", backend, ("gloo", "nccl"))
    require_real("timeout_s", timeout_s)
    check_world(world_size, backend)  # NCCL: CUDA present, one GPU per rank


class Ranks:
    """``world_size`` persistent ranks in one process group, each with its own namespace.

    A namespace starts with ``rank``, ``world_size``, ``device`` (``cuda:rank`` under
    NCCL, else ``cpu``), ``torch``, ``dist`` (torch.distributed) and ``comm``
    (:mod:`zerolearn.comm`). Each call waits at most ``timeout_s`` seconds.

    Args:
        world_size: number of ranks (processes), >= 1.
        backend: ``"gloo"`` (every rank on the CPU) or ``"nccl"`` (rank r on GPU r).
        timeout_s: seconds each call may take on every rank before all ranks are
            killed and restarted.

    Raises:
        ConfigError: a bad ``world_size``, ``backend`` or ``timeout_s``, or more NCCL
            ranks than GPUs; nothing has started.
        RankError: a rank could not join the process group.
        TimeoutError: the ranks did not all start within ``START_TIMEOUT_S`` seconds.
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 60.0):
        _validate(world_size, backend, timeout_s)
        self.world_size, self.backend, self.timeout_s = world_size, backend, float(timeout_s)
        self._procs: list = []
        self._conns: list = []
        self._store = None  # the ranks' store, hosted here while they run
        self._cells = 0
        _POOLS.add(self)
        self._start()

    # -- the reader's calls --

    def run(self, code: str, timeout_s: float | None = None) -> Outputs:
        """Execute ``code`` on every rank in its namespace; return what each rank printed.

        If the code ends with an expression, its value's ``repr`` is printed, as Jupyter
        shows a cell's value. A SyntaxError is raised here, before any rank runs.

        Args:
            code: Python source, run as one cell.
            timeout_s: seconds to wait for every rank (default: the pool's).

        Raises:
            SyntaxError: ``code`` does not parse (no rank has run it).
            CellError: a rank raised (its line in ``code`` is named) or some ranks did
                not finish in time or died (then all were restarted).
            KeyboardInterrupt: Ctrl-C while waiting; the ranks were killed and the next
                call starts fresh ones.
        """
        self._cells += 1
        filename = f"<cell {self._cells}>"
        ast.parse(code, filename)
        return self._ask(_exec, (code, filename), timeout_s)[0]

    def call(self, fn, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; each rank's result, by rank.

        ``fn`` travels by cloudpickle (a notebook's functions and closures too) and does
        not see the ranks' namespaces: use :meth:`push` and :meth:`run` for that.
        Printed output is discarded. Raises CellError as :meth:`run` does, and
        TypeError if cloudpickle cannot send ``fn`` or its arguments (nothing has run).
        """
        return self._ask(_call, (fn, args, kwargs))[1]

    def call_until(self, decides, fn, *args, grace_s: float = GRACE_S, timeout_s: float | None = None,
                   **kwargs) -> tuple[dict, dict, list[int]]:
        """``fn(*args, **kwargs)`` on every rank, ending as soon as one rank's result decides.

        Like :meth:`call`, but once some rank returns a result ``r`` with ``decides(r)``
        true (a verdict, say), the ranks still running get ``grace_s`` more seconds and
        are then killed: they may wait in a collective for the rank that returned, which
        nothing can wake. Fresh ranks start at the next call (variables lost). ``timeout_s``
        (default: the pool's) is this call's limit, in seconds.

        Returns:
            ``(results, failed, cut)``: each finished rank's result by rank, each rank that
            raised or died (its short traceback or exit code), and the ranks killed
            unfinished, at the decision's grace or at the pool's deadline.

        Raises:
            TypeError: cloudpickle cannot send ``fn`` or its arguments (nothing has run).
            CellError: a rank died between calls (the pool was restarted).
        """
        outputs, values, failed, unfinished = self._send_and_collect(_call, (fn, args, kwargs), timeout_s,
                                                                     decides, grace_s)
        if unfinished or not self.running:
            self._kill()  # fresh ranks start at the next call
        return values, {r: text for r, (_, text) in failed.items()}, unfinished

    def pull(self, name: str) -> list:
        """The value of variable ``name`` on every rank, by rank (tensors arrive as copies).

        Raises CellError (a NameError on the ranks) if a rank has no such variable.
        """
        return self._ask(_pull, (name,))[1]

    def push(self, **values) -> None:
        """Set each ``name=value`` in every rank's namespace (the same value on every rank)."""
        self._ask(_push, (values,))

    def restart(self) -> None:
        """Kill the ranks and start fresh ones: a new process group, empty namespaces."""
        self._kill()
        self._start()

    def close(self) -> None:
        """Stop the ranks (safe to call twice); a later call starts fresh ones."""
        for conn in self._conns:
            try:
                conn.send_bytes(b"")  # asks the rank to leave the group and exit
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=5)
        self._kill()

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Ranks({self.world_size}, backend={self.backend!r}, timeout_s={self.timeout_s:g}): {state}"

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes --

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        # The group's own timeout is longer than a call's, so the kernel's deadline comes
        # first; it still ends ranks left waiting in a collective if the kernel dies.
        group_timeout_s = self.timeout_s + 60
        # The kernel hosts the ranks' store (on a port the OS picks as it binds) and keeps it
        # until they have exited (_kill): no rank ever talks to a store that has gone.
        self._store = host_store(group_timeout_s)
        self._conns, self._procs = [], []
        for r in range(self.world_size):
            here, there = ctx.Pipe()
            env = hosted_store_env(self._store, r, self.world_size)
            p = ctx.Process(target=_serve, args=(r, self.world_size, env, self.backend, group_timeout_s, there),
                            daemon=True, name=f"zerolearn-rank-{r}")
            p.start()
            there.close()  # the rank holds the only other end: its exit shows here as EOF
            self._conns.append(here)
            self._procs.append(p)
        try:
            outputs, _, failed, unfinished = self._collect(time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        if failed or unfinished:
            self._kill()
            if failed:
                r = min(failed)
                raise RankError(r, f"could not join the process group:\n{failed[r][1]}{outputs[r]}")
            raise TimeoutError(f"{_who(unfinished)} did not start within {START_TIMEOUT_S:g} s")

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None  # the store goes last

    def _ask(self, fn, args: tuple, timeout_s: float | None = None) -> tuple[Outputs, list]:
        """Run ``fn(namespace, *args)`` on every rank; (outputs, results) by rank."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        outputs, values, failed, unfinished = self._send_and_collect(fn, args, timeout_s)
        # A rank that hangs or dies leaves its peers' collectives unmatched: the group
        # cannot be trusted any more, so every rank goes and fresh ones start.
        restarted = bool(unfinished) or not self.running
        if restarted:
            self.restart()
        if failed or unfinished:
            message = _explain(outputs, failed, unfinished, limit, restarted, self.world_size)
            raise CellError(message, outputs, {r: text for r, (_, text) in failed.items()}, unfinished, restarted)
        return outputs, [values[r] for r in range(self.world_size)]

    def _send_and_collect(self, fn, args: tuple, timeout_s: float | None, decides=None,
                          grace_s: float = GRACE_S) -> tuple[Outputs, dict, dict, list[int]]:
        """Send ``fn(namespace, *args)`` to every rank and collect (see :meth:`_collect`);
        results come back unpickled."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        require_real("timeout_s", limit)
        try:
            request = cloudpickle.dumps((fn, args))
        except Exception as e:  # noqa: BLE001 - pickling raises several types; one message for all
            raise TypeError(f"cannot send {args!r:.200} to the ranks ({type(e).__name__}: {e})") from e
        if not self._procs:  # stopped by close() or Ctrl-C: the reader knows the variables are gone
            self._start()
        elif not self.running:  # a rank died between calls (killed by the OS, say)
            dead = {r: (None, f"process exited with code {p.exitcode} since the last call\n")
                    for r, p in enumerate(self._procs) if not p.is_alive()}
            self.restart()
            raise CellError(_explain(Outputs([""] * self.world_size), dead, [], limit, True, self.world_size),
                            Outputs([""] * self.world_size), {r: t for r, (_, t) in dead.items()}, [], True)
        for conn in self._conns:
            conn.send_bytes(request)
        try:
            return self._collect(time.monotonic() + limit, decides, grace_s)
        except KeyboardInterrupt:
            self._kill()
            raise KeyboardInterrupt("ranks stopped; the next call starts fresh ones (variables lost)") from None

    def _collect(self, deadline: float, decides=None, grace_s: float = GRACE_S) -> tuple[Outputs, dict, dict,
                                                                                          list[int]]:
        """Read every rank's messages until each has replied or ``deadline`` (monotonic s).

        Returns (outputs, results unpickled, failures as (line, traceback), ranks that did
        not reply). A rank that exits without replying counts as failed; after a failure,
        or a result for which ``decides(result)`` is true, the others get ``GRACE_S``
        (``grace_s``) more seconds.
        """
        outputs = Outputs([""] * self.world_size)
        values: dict[int, bytes] = {}
        failed: dict[int, tuple[int | None, str]] = {}
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            waiting = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            # Wake at least every WAKE_S: a Ctrl-C (SIGINT) the OS hands to another thread of this
            # process (the kernel's own, gloo's) interrupts no wait here; Python raises it in the
            # main thread once this thread runs again.
            for ready in wait(list(waiting), timeout=min(WAKE_S, max(0.0, deadline - time.monotonic()))):
                r = waiting[ready]
                conn = self._conns[r]
                if r not in pending:
                    continue
                try:
                    if not conn.poll():  # exited, nothing left to read
                        raise EOFError
                    kind, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._procs[r].join(timeout=1)
                    kind, payload = "error", (None, f"process exited with code {self._procs[r].exitcode}\n")
                if kind == "out":
                    outputs[r] += payload
                    continue
                pending.discard(r)
                if kind == "ok":
                    values[r] = pickle.loads(payload)
                    if decides is not None and decides(values[r]):  # the others may wait for this one
                        deadline = min(deadline, time.monotonic() + grace_s)
                else:
                    failed[r] = payload
                    deadline = min(deadline, time.monotonic() + GRACE_S)  # the others may be waiting for it
        return outputs, values, failed, sorted(pending)


def _explain(outputs: Outputs, failed: dict, unfinished: list[int], limit: float, restarted: bool,
             world_size: int) -> str:
    """The reader's error: what every rank printed, each failure, who did not finish."""
    parts = [repr(outputs)] if any(outputs) else []
    alike: dict[tuple, list[int]] = {}  # ranks that failed the same way are named together
    for r in sorted(failed):
        alike.setdefault(failed[r], []).append(r)
    for (line, text), ranks in alike.items():
        where = f" at line {line} of the cell" if line is not None else ""
        parts.append(f"{_who(ranks)} failed{where}:\n" + "\n".join("    " + t for t in text.rstrip().splitlines()))
    if unfinished and failed:
        parts.append(f"{_who(unfinished)} had not finished {GRACE_S:g} s after {_who([min(failed)])} failed "
                     "(waiting for it in a collective, most likely).")
    elif unfinished:
        parts.append(f"{_who(unfinished)} did not finish within {limit:g} s: waiting in a collective that other "
                     "ranks never called, most likely (longer work needs a longer timeout: "
                     f"zerolearn.live.start({world_size}, timeout_s=...)).")
    if restarted:
        parts.append(f"All ranks were killed and {world_size} fresh ones started: every variable is lost; "
                     "run the cells that define them again.")
    return "\n".join(parts)


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
