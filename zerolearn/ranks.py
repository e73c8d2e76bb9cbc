"""Ranks as processes on one machine: a free port to meet on, their results collected by a
deadline, and their processes stopped.

:func:`zerolearn.dist.launch` spawns ``world_size`` ranks with these (each rank a fresh
``spawn`` process that joins a process group on 127.0.0.1 and sends its pickled result,
or its traceback, back on a queue), and :mod:`zerolearn.live` keeps ranks alive
between calls with them. Nothing here needs a process group.
"""

from __future__ import annotations

import pickle
import socket
import time
from typing import Any

__all__ = ["GRACE_S", "RankError", "collect", "free_port", "stop"]


class RankError(RuntimeError):
    """A spawned rank raised; ``rank`` says which, the message carries its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GRACE_S = 2.0  # once a rank has failed, how long the others may take to report their own failure
# What a rank reads when a peer stopped or died: a consequence, reported only if no rank has a cause.
_PEER_CAUSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "CollectiveError",
                "process exited with code")


def collect(queue, procs: list, timeout_s: float) -> dict[int, Any]:
    """Every rank's unpickled result, by rank, from ``queue``, where rank r's process
    ``procs[r]`` puts ``(rank, True, pickled result)`` or ``(rank, False, message)``.

    After the first failure the other ranks get ``GRACE_S`` seconds to report theirs, and
    the error raised is the first that a peer's stop or death did not cause (a closed
    connection, an exit code), so a consequence never hides the cause.

    Raises:
        RankError: a rank reported a failure, or its process exited without a result.
        TimeoutError: some ranks gave no result within ``timeout_s`` seconds.
    """
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []  # (rank, message), in the order they arrived
    deadline = time.monotonic() + timeout_s
    while len(results) + len(failures) < world_size and time.monotonic() <= deadline:
        if not queue.empty():
            rank, ok, value = queue.get()
            if ok:
                results[rank] = pickle.loads(value)
                continue
            failures.append((rank, value))
        else:
            # A rank killed outright (by the OS, say) sends nothing: its exit code tells.
            reported = set(results) | {r for r, _ in failures}
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
            if dead and queue.empty():
                failures.append((dead[0], f"process exited with code {procs[dead[0]].exitcode}"))
            else:
                time.sleep(0.01)
                continue
        if len(failures) == 1:  # the others may be waiting for the failed rank in a collective
            deadline = min(deadline, time.monotonic() + GRACE_S)
    if failures:
        causes = [f for f in failures if not any(words in f[1].split("\n", 1)[0] for words in _PEER_CAUSED)]
        raise RankError(*(causes or failures)[0])
    if len(results) < world_size:
        raise TimeoutError(f"launch: ranks {sorted(set(range(world_size)) - set(results))} "
                           f"gave no result within {timeout_s:.0f} s")
    return results


def stop(procs: list, kill: bool) -> None:
    """Wait for every process of ``procs`` to end (30 s each, then kill it); ``kill``: kill them first."""
    for p in procs:
        if kill:  # after a failure the others may wait in a collective for a dead peer
            p.kill()
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
