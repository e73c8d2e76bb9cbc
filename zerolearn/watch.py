"""The ledger watches torch.distributed itself: collectives called by torch's names, booked.

A reader writes ``dist.all_reduce(t)``, ``dist.reduce_scatter_single(out, inp)``,
``dist.all_gather_single(out, inp)``, ``dist.broadcast(t, src)``, with or without
``async_op=True``: what they will type at work. Inside :func:`watching`, every such call
is booked in :data:`zerolearn.comm.LEDGER` by calls, elements and bytes, as if it had gone
through :mod:`zerolearn.comm`, wherever it is made (the reader's function, a hook that
autograd runs during backward, a library the reader calls).

How: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator torch
dispatches, and each torch.distributed collective is one operator of the ``c10d``
namespace, whatever the Python name that called it (``dist.reduce_scatter_single`` and the
name torch 2.11 gives it, ``reduce_scatter_tensor``, reach the same op):

============================== ====================== ===================================
c10d operator                   booked as              elements (comm's convention, Sec 7.1)
============================== ====================== ===================================
``allreduce_``                  ``all_reduce``         the tensor
``_reduce_scatter_base_``       ``reduce_scatter``     the input (n * world_size)
``reduce_scatter_``             ``reduce_scatter``     every input of the list
``_allgather_base_``            ``all_gather``         the output (n * world_size)
``allgather_``                  ``all_gather``         every output of the list
``broadcast_``                  ``broadcast``          the tensor
============================== ====================== ===================================

Calls made through :mod:`zerolearn.comm` are booked there already and skipped here
(:func:`zerolearn.comm.booking`), so nothing counts twice; ``barrier`` and the object
collectives (``all_gather_object``: a gather of sizes, then of bytes) are bookkeeping and
not booked. The seconds booked are those of the launch only: a dispatch mode does not
see ``work.wait()``. Each booked call also goes through :func:`zerolearn.guard.before`,
so it is numbered like comm's, and in debug mode the ranks compare it before it runs.

What :mod:`zerolearn.comm` adds over torch's names, and why the engines keep it: a
timeout or dead peer named in a :class:`~zerolearn.guard.CollectiveError`; a wait until
gloo lets go of the buffers (so that memory measured right after a collective is the same
on every run); gloo's reduce-scatter without the clone of the whole input
(``overwrite_input``); labels for the profiler and the timeline.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from zerolearn import comm, guard

__all__ = ["Watch", "watching"]


def _tensors(x) -> list[torch.Tensor]:
    """Every tensor in ``x``: a tensor, or a list (of lists) of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _tensors(item)] if isinstance(x, (list, tuple)) else []


# c10d operator -> (ledger op, index of the argument whose elements count, index of the group argument)
_BOOKED = {
    "allreduce_": ("all_reduce", 0, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),
    "broadcast_": ("broadcast", 0, 1),
}


def _group(boxed):
    """The Python process group of a c10d operator's group argument (None: the default group)."""
    unbox = getattr(dist.ProcessGroup, "unbox", None)
    try:
        pg = unbox(boxed) if unbox is not None else None
    except (RuntimeError, TypeError):  # pragma: no cover - a group torch cannot unbox: treat as the default
        return None
    return None if pg is None or pg == dist.group.WORLD else pg


_OBJECTS = frozenset({"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"})


def _for_objects() -> bool:
    """Whether torch's object collectives (pickled Python objects: bookkeeping) issued this call."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _OBJECTS and "distributed" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Watch(TorchDispatchMode):
    """Book every torch.distributed collective dispatched while this mode is on in
    :data:`zerolearn.comm.LEDGER` (see the module's docstring for what counts)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        booked = _BOOKED.get(func._opname) if func.namespace == "c10d" else None
        if booked is None or comm.booking():
            return func(*args, **kwargs)
        op, counted_at, group_at = booked
        counted = _tensors(args[counted_at])
        if not counted or _for_objects():
            return func(*args, **kwargs)
        group = _group(args[group_at])
        agreed = f"{op}(src={args[2]})" if op == "broadcast" else op  # every rank names the same source
        guard.before(agreed, tuple(tuple(t.shape) for t in _tensors(args[:group_at])), counted[0].dtype, group)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0
        comm.LEDGER.book(op, sum(t.numel() for t in counted), counted[0].element_size(), seconds)
        return out


@contextlib.contextmanager
def watching():
    """Inside this block, torch.distributed collectives called by torch's names (``dist.all_reduce``,
    ``dist.reduce_scatter_single``, ``dist.all_gather_single``, ``dist.broadcast``, sync or
    ``async_op=True``) are booked in :data:`zerolearn.comm.LEDGER`. Yields the ledger. The block
    watches this thread (autograd's hooks on CPU tensors run in it too)."""
    with Watch():
        yield comm.LEDGER
