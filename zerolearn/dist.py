"""Process-group setup: torchrun, standalone, or ranks spawned from a notebook.

Three ways to get ranks, one result (a :class:`DistContext`):

* under ``torchrun`` the environment names this process's RANK, WORLD_SIZE and
  LOCAL_RANK; :func:`init` validates them and joins the job;
* run plainly (``python -m zerolearn.train``) it is a job of world size 1;
* :func:`launch` spawns ``world_size`` gloo ranks on this machine, runs a function in
  each and returns each rank's result: that is how notebooks and tests get several
  real ranks on a laptop. The calling process hosts the job's store (:func:`host_store`,
  a TCPStore bound to a port the operating system picks, so launches started side by
  side never compete for one), as torchrun's agent hosts its job's; each rank is a fresh
  process (``spawn``) that joins it through torchrun's environment variables, runs the
  function and sends the pickled result, or its traceback, back on a queue (the
  processes and their results: :mod:`zerolearn.ranks`). The store outlives every rank,
  so no rank ever talks to a store that has gone.

Every process group gets a timeout, so a rank that dies or takes a different code
path makes the others fail with an error instead of hanging forever.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerolearn import compat
from zerolearn.errors import ConfigError
from zerolearn.ranks import RankError, collect, free_port, stop

__all__ = ["DEFAULT_TIMEOUT_S", "ConfigError", "DistContext", "RankError", "RendezvousError", "check_world",
           "context", "free_port", "host_store", "hosted_store_env", "init", "launch", "resolve_backend_device",
           "store", "teardown", "torchrun_env"]

DEFAULT_TIMEOUT_S = float(os.environ.get("ZEROLEARN_TIMEOUT", "300"))
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RendezvousError(RuntimeError):
    """This rank could not join the job's store at MASTER_ADDR:MASTER_PORT in time."""


@dataclass(frozen=True)
class DistContext:
    """Who this process is: rank in ``world_size`` ranks, its backend and device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


_CONTEXT: DistContext | None = None


def context() -> DistContext:
    """The context set by :func:`init`; raises RuntimeError before it."""
    if _CONTEXT is None:
        raise RuntimeError("zerolearn.dist.init() has not been called in this process")
    return _CONTEXT


def resolve_backend_device(backend: str = "auto", device: str = "auto") -> tuple[str, str]:
    """Pick ("nccl", "cuda") when CUDA is there and ("gloo", "cpu") otherwise.

    Raises:
        ConfigError: unknown names, ``nccl`` or ``cuda`` asked for without CUDA, or
            ``nccl`` with ``cpu`` (NCCL only moves CUDA tensors).
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"--backend {backend!r}: allowed are auto, gloo, nccl")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: allowed are auto, cpu, cuda")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ConfigError("--device cuda: CUDA is not available on this machine; use cpu or auto")
    if backend == "nccl" and not has_cuda:
        raise ConfigError("--backend nccl: CUDA is not available on this machine; use gloo or auto")
    if device == "auto":
        device = "cuda" if (has_cuda and backend != "gloo") else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("--backend nccl needs --device cuda (NCCL moves only CUDA tensors)")
    return backend, device


def torchrun_env(env: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's variables, or None if absent.

    Raises:
        ConfigError: some variables set and others missing, non-integers, or values
            out of range (rank >= world_size, world_size < 1).
    """
    env = os.environ if env is None else env
    present = [v for v in _TORCHRUN_VARS if v in env]
    if not present:
        return None
    missing = [v for v in _TORCHRUN_VARS if v not in env]
    if missing:
        raise ConfigError(
            f"torchrun environment incomplete: {', '.join(present)} set but "
            f"{', '.join(missing)} missing; launch with torchrun or unset them"
        )
    try:
        rank, world, local = (int(env[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as e:
        raise ConfigError(f"torchrun variables must be integers: {e}") from None
    if world < 1 or not 0 <= rank < world or not 0 <= local <= rank:
        raise ConfigError(
            f"inconsistent torchrun variables RANK={rank} WORLD_SIZE={world} "
            f"LOCAL_RANK={local}: need 0 <= LOCAL_RANK <= RANK < WORLD_SIZE"
        )
    return rank, world, local


_STORE: dist.Store | None = None  # the store behind the default process group (see store())
_OWN_STORE = False  # this process (rank 0 of an env:// job without a launcher's store) hosts it
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torch's variable: every rank is a client of a launcher's store


def host_store(timeout_s: float | None = None) -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1, on a port the operating system picks as it binds
    (``.port`` says which): the store of a job whose ranks this process starts.

    Binding port 0 cannot lose a race: two launches side by side get two ports, where a
    port found free and bound later may meanwhile be taken. The ranks join it as
    clients (:func:`hosted_store_env`), as torchrun's workers join their agent's store,
    and it lives as long as this object: keep it until every rank has exited.

    Raises:
        ConfigError: ``timeout_s`` not a positive number.
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r}: must be a number of seconds > 0")
    return dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def hosted_store_env(server: dist.TCPStore, rank: int, world_size: int) -> dict[str, str]:
    """torchrun's environment variables for rank ``rank`` of ``world_size`` ranks that meet
    at ``server`` (from :func:`host_store`), all as its clients (torch's own
    ``TORCHELASTIC_USE_AGENT_STORE``, which torchrun sets for its workers)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), _AGENT_STORE: str(True),
            "TORCHELASTIC_RESTART_COUNT": "0"}


def init(backend: str = "auto", device: str = "auto", timeout_s: float | None = None,
         simulate_world_size: int | None = None) -> DistContext:
    """Join (or create) the default process group and return this rank's context.

    Under torchrun, uses its environment; otherwise creates a world of size 1 in this
    process. With ``simulate_world_size=N`` this process is rank 0 of N on torch's
    "fake" backend: collectives move no data, but every shard and buffer has the
    size it would have on N ranks. Calling it again returns the existing context.

    Raises:
        ConfigError: see :func:`resolve_backend_device` and :func:`torchrun_env`;
            ``simulate_world_size`` < 1 or combined with torchrun; MASTER_PORT held.
        RendezvousError: the job's store did not answer within ``timeout_s``.
    """
    global _CONTEXT
    if _CONTEXT is not None and dist.is_initialized():
        return _CONTEXT
    backend, device_type = resolve_backend_device(backend, device)
    ranks = torchrun_env()
    if simulate_world_size is not None:
        return _init_simulated(simulate_world_size, device_type, ranks is not None)
    rank, world, local = ranks if ranks is not None else (0, 1, 0)
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} GPU(s); "
                "NCCL cannot put two ranks on one GPU"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    global _STORE
    if ranks is None:
        # A world of one needs no rendezvous: an in-memory store does.
        _STORE = dist.HashStore()
        dist.init_process_group(backend, store=_STORE, rank=0, world_size=1, timeout=timeout)
    else:
        # torchrun's agent keeps one rendezvous store for all restarts of a job; keys
        # left by a failed attempt (peers' addresses) must not be read by the next one,
        # so each attempt works under its own prefix.
        store = _rendezvous(rank, world, timeout)
        global _OWN_STORE
        # Rank 0 hosts the store itself unless a launcher does (torchrun's agent, launch, live ranks).
        _OWN_STORE = rank == 0 and os.environ.get(_AGENT_STORE) != str(True)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _STORE = dist.PrefixStore(f"zerolearn/attempt{attempt}", store)
        dist.init_process_group(backend, store=_STORE, rank=rank, world_size=world, timeout=timeout)
    _CONTEXT = DistContext(rank, world, local, backend, dev)
    return _CONTEXT


def _rendezvous(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's env:// rendezvous, bounded by ``timeout`` and with clear errors.

    A port that accepts connections but is not a torch.distributed store (another
    program holds MASTER_PORT) keeps torch's store client waiting past its own
    timeout; here the wait runs on a helper thread and this rank gives up on time.

    Raises:
        ConfigError: rank 0 cannot listen on MASTER_PORT (address already in use).
        RendezvousError: no store answered within ``timeout``.
    """
    import threading

    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    out: dict[str, Any] = {}

    def join() -> None:
        try:
            out["store"] = next(dist.rendezvous("env://", rank, world, timeout=timeout))[0]
        except Exception as e:  # noqa: BLE001 - reported by the caller below
            out["error"] = e

    thread = threading.Thread(target=join, name="zerolearn-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + 5)
    if "store" in out:
        return out["store"]
    error = out.get("error")
    if error is not None and "EADDRINUSE" in str(error):
        raise ConfigError(f"MASTER_PORT {port}: address already in use on {addr}, another program holds it; "
                          "allowed: a free port (torchrun --master-port N)") from error
    what = f"failed ({type(error).__name__}: {error})" if error is not None else "got no answer"
    raise RendezvousError(f"rank {rank}: joining the job's store at {addr}:{port} {what} within "
                          f"--timeout {timeout.total_seconds():g} s; is rank 0 running, and is that port "
                          "its store and not another program's?")


def store() -> dist.Store | None:
    """The key-value store this process's group was built on (None before :func:`init`).

    Failure reports (:mod:`zerolearn.guard`) post to it; it outlives a failed collective.
    """
    return _STORE if dist.is_initialized() else None


def _init_simulated(world_size: int, device_type: str, under_torchrun: bool) -> DistContext:
    global _CONTEXT
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"--simulate-world-size {world_size!r}: must be an integer >= 1")
    if under_torchrun:
        raise ConfigError("--simulate-world-size runs one process; do not launch it with torchrun")
    dev = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=world_size)
    _CONTEXT = DistContext(0, world_size, 0, "fake", dev)
    return _CONTEXT


LEAVE_S = 120.0
"""Seconds rank 0, when its process hosts the job's store, waits at a clean :func:`teardown` for
every peer to have left before it may exit (see :func:`teardown`)."""
_TEARDOWNS = 0  # clean teardowns in this process: each one's keys on the store are its own


def teardown(clean: bool = True) -> None:
    """Leave the process group (safe to call when none exists), in an order that lets no rank
    close what a peer still uses.

    ``clean=True`` (the normal end of a job): a barrier, so that no rank closes its
    connections while a peer is still finishing the last collective (gloo aborts the peer's
    process if that happens); the last references to finished collectives dropped while
    gloo's threads still run (left to interpreter shutdown, freeing them can abort the
    process); the group destroyed, and what only a reference cycle still held collected now,
    not at interpreter exit. The store must outlive every rank that talks to it: a peer
    whose store vanishes mid-request has c10d print a C++ stack trace ("Did the remote
    server shutdown or crash?") on its stderr. Where a launcher hosts it (torchrun's agent,
    :func:`launch`, :mod:`zerolearn.live`) it does, and nothing more is needed. Where rank
    0's own process hosts it (plain ``env://`` with MASTER_PORT set by hand), every other
    rank posts on the store that it has left and goes, without waiting for an answer, and
    rank 0 waits (at most :data:`LEAVE_S` seconds) until all have posted before it exits.
    After a failure, pass False: the group is destroyed at once, without waiting for peers
    that may be gone.
    """
    global _CONTEXT, _STORE, _TEARDOWNS, _OWN_STORE
    store, world = _STORE, dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():
        real = world > 1 and dist.get_backend() != "fake"
        if clean and real:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
        rank = _CONTEXT.rank if _CONTEXT is not None else 0
        if clean and real and store is not None and _hosted_by_rank0(store):
            _leave(store, rank, world, _TEARDOWNS, rank == 0 and _OWN_STORE)
            _TEARDOWNS += 1
    _CONTEXT, _STORE, _OWN_STORE = None, None, False


def _hosted_by_rank0(store: dist.Store) -> bool:
    """Whether the job's store lives in rank 0's process (not a launcher's)."""
    return _OWN_STORE or os.environ.get(_AGENT_STORE) != str(True)


def _leave(store: dist.Store, rank: int, world: int, epoch: int, host: bool) -> None:
    """Post that ``rank`` has left its process group; the ``host`` of the store (rank 0) then
    waits until all ``world`` ranks have posted, at most :data:`LEAVE_S` seconds. A peer only
    sends (a set asks for no reply), so no peer is ever inside a request when the host exits."""
    key = f"zerolearn/teardown/{epoch}"
    try:
        store.set(f"{key}/{rank}", "left")
        if host:
            store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=LEAVE_S))
    except Exception:  # noqa: BLE001 - a peer or the store already gone: nothing left to wait for
        pass


def _worker(rank, world_size, env: dict[str, str], backend, call: bytes, timeout_s, queue) -> None:
    """Rank ``rank`` of :func:`launch`: join the group (``env``: torchrun's variables, the
    store the launcher hosts), run the pickled ``call``, put its result (or its traceback)
    on ``queue``, leave the group."""
    os.environ.update(env)
    # Ranks share the machine's cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        init(backend, "cuda" if backend == "nccl" else "cpu", timeout_s)
        fn, args, kwargs = pickle.loads(call)  # cloudpickle's output is plain pickle data
        # (Cloud)pickle copies tensors by value; torch's queue pickler would share them
        # through file descriptors that vanish when this process exits.
        result = cloudpickle.dumps(fn(*args, **kwargs))
        teardown()
        queue.put((rank, True, result))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        teardown(clean=False)


def check_world(world_size: int, backend: str) -> None:
    """Refuse, before anything starts, ``world_size`` ranks on ``backend`` that this machine cannot run.

    Raises:
        ConfigError: ``world_size`` < 1, an unknown ``backend``, NCCL without CUDA or
            with more ranks than GPUs.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: must be an integer >= 1")
    resolve_backend_device(backend, "cuda" if backend == "nccl" else "cpu")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ConfigError(f"world_size={world_size} NCCL ranks need as many GPUs; "
                          f"this machine has {torch.cuda.device_count()}")


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
    check_world(world_size, backend)
    try:
        call = cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - pickling raises several types; one message for all
        raise TypeError(f"launch: cannot send {fn!r} and its arguments to the ranks "
                        f"({type(e).__name__}: {e})") from e
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    server = host_store(timeout_s + 60)  # outlives the ranks: they all are its clients
    procs = [ctx.Process(target=_worker, args=(r, world_size, hosted_store_env(server, r, world_size), backend, call,
                                               timeout_s, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    finished = False
    try:
        results = collect(queue, procs, timeout_s)
        finished = True
    finally:
        stop(procs, kill=not finished)
        del server  # every rank has exited
    return [results[r] for r in range(world_size)]
