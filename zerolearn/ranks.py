"""Real ranks on one machine: :func:`launch` spawns them, runs a function in each and
returns each rank's result. That is how notebooks and tests get several gloo ranks on a
laptop (or NCCL ranks, one per GPU). :mod:`zerolearn.dist` sets up each rank's process
group and re-exports :func:`launch`, :func:`free_port` and :class:`RankError`.

Each rank is a fresh process (``spawn``): it imports the package, joins a process group
on 127.0.0.1 through torchrun's environment variables, runs the function and sends the
pickled result, or its traceback, back on a queue.

The function travels to the ranks with ``cloudpickle``, which copies a function
defined in a notebook (or any ``__main__``), a lambda or a closure by value, together
with the variables it uses, and an importable function by name. Results come back the
same way, so a rank may return an instance of a class defined in the notebook.
:mod:`zerolearn.live` keeps ranks alive between calls instead.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as mp

from zerolearn.errors import ConfigError

__all__ = ["RankError", "free_port", "launch"]


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


def _worker(rank, world_size, port, backend, call: bytes, timeout_s, queue) -> None:
    # Imported here, not at the top: zerolearn.dist imports this module to re-export launch.
    from zerolearn import dist as zdist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    # Ranks share the machine's cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        zdist.init(backend, "cuda" if backend == "nccl" else "cpu", timeout_s)
        fn, args, kwargs = pickle.loads(call)  # cloudpickle's output is plain pickle data
        # (Cloud)pickle copies tensors by value; torch's queue pickler would share them
        # through file descriptors that vanish when this process exits.
        result = cloudpickle.dumps(fn(*args, **kwargs))
        zdist.teardown()
        queue.put((rank, True, result))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        zdist.teardown(clean=False)


def _check(world_size: int, backend: str) -> None:
    from zerolearn.dist import resolve_backend_device

    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: must be an integer >= 1")
    resolve_backend_device(backend, "cuda" if backend == "nccl" else "cpu")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ConfigError(f"world_size={world_size} NCCL ranks need as many GPUs; "
                          f"this machine has {torch.cuda.device_count()}")


GRACE_S = 2.0  # once a rank has failed, how long the others may take to report their own failure
# What a rank reads when a peer stopped or died: a consequence, reported only if no rank has a cause.
_PEER_CAUSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "CollectiveError",
                "process exited with code")


def _collect(queue, procs: list, timeout_s: float) -> dict[int, Any]:
    """Every rank's unpickled result, by rank; raises at the deadline, or once a rank failed.

    After the first failure the other ranks get ``GRACE_S`` seconds to report theirs, and
    the error raised is the first that a peer's stop or death did not cause (a closed
    connection, an exit code), so a consequence never hides the cause.
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


def _stop(procs: list, kill: bool) -> None:
    for p in procs:
        if kill:  # after a failure the others may wait in a collective for a dead peer
            p.kill()
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
           backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return results by rank.

    ``backend="gloo"`` (default) puts every rank on the CPU; ``"nccl"`` gives rank r
    GPU r, so ``world_size`` must not exceed the GPUs present.

    ``fn`` may be any function: defined in a module, in a notebook or ``__main__``, a
    lambda or a closure. It and ``args``/``kwargs`` are sent to each rank with
    cloudpickle (by value, except functions and classes importable by name, which the
    ranks import), and so is each rank's result: tensors arrive as copies. Inside
    ``fn``, :func:`zerolearn.dist.context` gives the rank.

    Raises:
        ConfigError: ``world_size`` < 1, an unknown ``backend``, more NCCL ranks than GPUs.
        TypeError: cloudpickle cannot serialize ``fn``, ``args`` or ``kwargs`` (a lock, an
            open file, a generator); nothing has started.
        RankError: a rank raised; the first error that a peer's stop or death did not
            cause is re-raised with its rank and traceback, and the other ranks are stopped.
        TimeoutError: no result within ``timeout_s`` seconds (all ranks stopped).
    """
    _check(world_size, backend)
    try:
        call = cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - pickling raises several types; one message for all
        raise TypeError(f"launch: cannot send {fn!r} and its arguments to the ranks "
                        f"({type(e).__name__}: {e})") from e
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, call, timeout_s, queue),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    finished = False
    try:
        results = _collect(queue, procs, timeout_s)
        finished = True
    finally:
        _stop(procs, kill=not finished)
    return [results[r] for r in range(world_size)]
