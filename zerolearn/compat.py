"""Differences between the torch versions zerolearn supports, in one place.

zerolearn runs on torch 2.11 (CUDA machines) and 2.13 (CPU, CI). Everything that
changed name or location between them is resolved here, once, so the rest of the
package reads as if there were a single torch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

TORCH_VERSION: str = torch.__version__.split("+")[0]

# torch 2.13 names the tensor-in/tensor-out collectives ``dist.reduce_scatter_single`` and
# ``dist.all_gather_single`` and deprecates ``reduce_scatter_tensor`` and
# ``all_gather_into_tensor`` (a FutureWarning on first use). torch 2.11 has only the old
# names. The book, its readers and the engines write 2.13's names; on a torch that lacks them,
# importing zerolearn adds them to ``torch.distributed`` as the old functions themselves (same
# arguments, same op underneath), so one text runs on both. A plain script run without
# zerolearn on torch < 2.13 writes the old names.
SINGLE_NAMES: dict[str, str] = {"reduce_scatter_single": "reduce_scatter_tensor",
                                "all_gather_single": "all_gather_into_tensor"}
for _new, _old in SINGLE_NAMES.items():
    if not hasattr(dist, _new):  # pragma: no cover - torch < 2.13 (the CUDA machines' 2.11)
        setattr(dist, _new, getattr(dist, _old))


def fully_shard():
    """torch's FSDP2 ``fully_shard`` (public since 2.6; private module before)."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard as fn
    return fn


def fake_store():
    """The store for torch's "fake" backend, whose collectives move no data.

    It lets one process play rank 0 of an N-rank job: shapes, shards and buffers
    are real, so the memory of rank 0 is measured as if N ranks existed.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def record_cuda_memory_history(on: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) torch's record of every CUDA allocation with its stack.

    ``torch.cuda.memory._record_memory_history`` has kept this signature from 2.1 to
    2.13 but is underscored; its one caller goes through here.
    """
    torch.cuda.memory._record_memory_history("all" if on else None, max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded history as a pickle for https://pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def use_counts(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """References that hold ``tensor``: to its Python object, to the tensor itself and
    to its storage (views, a communication backend's work and the tensors it made;
    a C++ thread letting go of the last one also drops a Python reference, which
    needs the GIL and so can come later).

    ``Tensor._use_count`` and ``torch._C._storage_Use_Count`` are underscored (testing
    aids, in 2.11 and 2.13); None where either is missing, and callers then skip what
    needs them.
    """
    storage_count = getattr(torch._C, "_storage_Use_Count", None)
    if storage_count is None or not hasattr(tensor, "_use_count"):
        return None
    return sys.getrefcount(tensor), tensor._use_count(), storage_count(tensor.untyped_storage()._cdata)
