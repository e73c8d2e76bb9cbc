"""An async collective's output read before its handle's ``wait()``, caught where it happens.

``dist.all_reduce(t, async_op=True)`` returns at once, with a handle; gloo's or NCCL's own
thread writes ``t`` later, and only ``handle.wait()`` says it has. Code that reads ``t``
before the wait reads whatever is there at that moment: on an idle machine usually the
result, under load a partial sum. A check sees only a wrong number, sometimes; this module
names the cause.

Inside :func:`pending_reads`, the collectives torch names (``dist.all_reduce``,
``dist.reduce_scatter_single``, ``dist.all_gather_single``, ``dist.broadcast``) called with
``async_op=True`` mark their output's storage as pending until the handle's ``wait()``
(or an ``is_completed()`` that answers True; a handle turned into a future with
``get_future()`` is left to the reader). A dispatch mode sees every torch operator: one
that reads or writes a pending storage, other than a view of it, raises
:class:`ReadBeforeWait` naming the collective, the operator and the line.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast")
"""torch's names watched; each one's first argument is its output."""


class ReadBeforeWait(RuntimeError):
    """An operator used an async collective's output before its handle was waited for."""


__all__ = ["COLLECTIVES", "ReadBeforeWait", "pending_reads"]


class _Pending(TorchDispatchMode):
    """Storages (by data pointer) an async collective may still write: what launched each."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, str] = {}
        self.works: dict[int, int] = {}  # id(handle) -> storage data pointer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.storages and func.namespace != "c10d" and not func.is_view:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    launched = self.storages.get(t.untyped_storage().data_ptr())
                    if launched is not None:
                        self.storages.clear()  # said once; the reader fixes this one first
                        raise ReadBeforeWait(
                            f"the output of {launched} was used by torch's {func.overloadpacket.__name__} before "
                            "its handle's .wait(): an async collective's output is written by the backend's own "
                            "thread and is final only once handle.wait() has returned; call it before reading or "
                            "writing the tensor (or any view of it)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def pending_reads(where: Callable[[], str] = lambda: ""):
    """Inside this block, an async collective's output used before its handle's ``wait()``
    raises :class:`ReadBeforeWait` (see the module's docstring). ``where()`` says, as
    ``' (line N: code)'``, where the current call is (the checker passes the reader's line)."""
    mode = _Pending()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    work_type = torch._C._distributed_c10d.Work
    methods = {name: getattr(work_type, name) for name in ("wait", "is_completed", "get_future")}

    def settle(work) -> None:
        ptr = mode.works.pop(id(work), None)
        if ptr is not None:
            mode.storages.pop(ptr, None)

    def watched(name):
        collective = originals[name]
        signature = inspect.signature(collective)
        first = next(iter(signature.parameters))  # the output: tensor, output_tensor or output

        def call(*args, **kwargs):
            work = collective(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return work  # torch raised or will: not this module's concern
            output = bound.get(first)
            if work is not None and bound.get("async_op") and isinstance(output, torch.Tensor):
                ptr = output.untyped_storage().data_ptr()
                mode.storages[ptr] = f"dist.{name}(..., async_op=True){where()}"
                mode.works[id(work)] = ptr
            return work

        return call

    def wait(self, *args, **kwargs):
        out = methods["wait"](self, *args, **kwargs)
        settle(self)
        return out

    def is_completed(self):
        done = methods["is_completed"](self)
        if done:
            settle(self)
        return done

    def get_future(self):
        settle(self)  # the reader waits on the future instead: not followed
        return methods["get_future"](self)

    try:
        for name in COLLECTIVES:
            setattr(dist, name, watched(name))
        work_type.wait, work_type.is_completed, work_type.get_future = wait, is_completed, get_future
        with mode:
            yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        work_type.wait, work_type.is_completed, work_type.get_future = (
            methods["wait"], methods["is_completed"], methods["get_future"])

