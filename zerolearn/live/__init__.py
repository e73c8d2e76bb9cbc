"""Persistent ranks for a notebook: build a model in one cell, reduce-scatter in the next.

:func:`zerolearn.dist.launch` starts ranks, runs one function and ends them. Here
``world_size`` spawned processes join one process group once and each keeps a Python
namespace between calls, so a notebook can work on real ranks cell by cell::

    %load_ext zerolearn.live

    %%ranks 2
    x = torch.arange(4.0) + rank        # runs on every rank; rank, world_size, device,
    shard = torch.empty(2)              # torch, dist and comm are predefined
    comm.reduce_scatter(shard, x)
    print(shard)                        # shown as "[rank 0] tensor([1., 3.])" ...

From Python the same pool is :class:`Ranks` (``run``, ``call``, ``call_until``, ``pull``, ``push``).

Why not ipyparallel? It keeps engines alive and its ``%%px`` labels output by engine,
but it brings a controller, ZMQ and per-engine startup, and it knows nothing of
torch.distributed: each engine would still have to join the process group, and a rank
blocked inside a gloo collective ignores Ctrl-C, so after a hang someone must kill
every engine and rejoin the group by hand. A few spawned processes and their pipes do
what we need with nothing but :mod:`multiprocessing`: join one group with a timeout,
put a deadline on every call, kill and restart all ranks together when one hangs, and
label every line of output with its rank.

Every wait has a deadline. A call that some ranks do not finish within ``timeout_s``
(a collective only some ranks called, an endless loop) kills all ranks and starts
fresh ones: their variables are lost, and the error says so. Ctrl-C while waiting
kills them too; the next call starts fresh ones.

The rank side is :mod:`zerolearn.live.rank`, the kernel side :mod:`zerolearn.live.pool`,
the default pool and the magic :mod:`zerolearn.live.magic`.
"""

from zerolearn.live.magic import current, load_ipython_extension, start, stop
from zerolearn.live.pool import CellError, Outputs, Ranks

__all__ = ["CellError", "Outputs", "Ranks", "current", "load_ipython_extension", "start", "stop"]
