"""The rank side of :mod:`zerolearn.live`: one spawned process per rank, serving the kernel.

``_serve`` is the process's entry point (module-level, so ``spawn`` can import it by
name): it joins the process group, then runs each request the kernel sends, a pickled
``fn(namespace, *args)``, and answers with printed output, a result or a short
traceback. The protocol's other end is :class:`zerolearn.live.pool.Ranks`.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import signal
import sys
import threading
import traceback

import cloudpickle
import torch


class _Pipe:
    """The rank's end of its pipe; also its sys.stdout and sys.stderr."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, kind: str, payload) -> None:
        with self.lock:  # a thread that prints must not interleave with a reply
            self.conn.send_bytes(pickle.dumps((kind, payload)))

    def write(self, text: str) -> int:
        if text:
            self.send("out", text)
        return len(text)

    def flush(self) -> None:
        pass


def _serve(rank: int, world_size: int, env: dict[str, str], backend: str, timeout_s: float, conn) -> None:
    # Ctrl-C in Jupyter signals the kernel's whole process group; the kernel decides
    # what happens to ranks (it kills them), so a rank never dies half-way by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)  # torchrun's variables; the store is the kernel's (zerolearn.dist.host_store)
    torch.set_num_threads(1)  # ranks share the machine's cores, as in zerolearn.dist.launch
    pipe = _Pipe(conn)
    sys.stdout = sys.stderr = pipe
    namespace: dict = {}
    request = pickle.dumps((_join, (rank, world_size, backend, timeout_s)))
    try:
        while request is not None:
            try:
                fn, args = pickle.loads(request)
                reply = ("ok", cloudpickle.dumps(fn(namespace, *args)))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the kernel
                reply = ("error", _short_traceback(e))
            pipe.send(*reply)
            request = conn.recv_bytes() or None  # empty bytes: close
    except (EOFError, OSError):
        return  # the kernel is gone: nobody to serve
    from zerolearn import dist as zdist

    # Asked to close: every rank was asked, so all leave together (a barrier, then the group
    # destroyed). The store is the kernel's, which keeps it until every rank has exited, so
    # no rank talks to a store that has gone (c10d would print its store errors into the
    # kernel's next cell). A rank that cannot finish this is killed by the kernel's close.
    zdist.teardown(clean=True)


def _join(namespace: dict, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    from zerolearn import comm
    from zerolearn import dist as zdist

    device = zdist.init(backend, "cuda" if backend == "nccl" else "cpu", timeout_s).device  # cuda:rank or cpu
    namespace.update(__name__="__main__", rank=rank, world_size=world_size, device=device, torch=torch,
                     dist=dist, comm=comm)


def _exec(namespace: dict, code: str, filename: str) -> None:
    """Run a cell; if it ends with an expression (and no ``;``), print its value as Jupyter shows it."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # for tracebacks
    tree = ast.parse(code, filename)
    shown = tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";")
    last = tree.body.pop() if shown else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        if value is not None:
            print(repr(value))


def _call(namespace: dict, fn, args: tuple, kwargs: dict):
    return fn(*args, **kwargs)


def _pull(namespace: dict, name: str):
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined on rank {namespace['rank']}")
    return namespace[name]


def _push(namespace: dict, values: dict) -> None:
    namespace.update(values)


def _short_traceback(e: BaseException) -> tuple[int | None, str]:
    """(line of the first cell frame or None, the traceback without this module's frames)."""
    # Every frame between _serve and the reader's code is in this file, so dropping this
    # file's frames leaves the reader's own (and the zerolearn code it called).
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
    line = next((f.lineno for f in frames if f.filename.startswith("<cell")), None)
    text = "".join(traceback.format_list(frames) + traceback.format_exception_only(type(e), e))
    return line, text
