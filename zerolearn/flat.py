"""Flat parameter buffers: many tensors as one, padded and sharded by element.

ZeRO partitions model states by *element*, not by tensor (Sec 5): a group of
parameters is laid end to end in one 1-D buffer, the buffer is padded with zeros
to a multiple of the number of shards, and shard r is the r-th equal slice. Shards
are then equal whatever the layer sizes, and one reduce_scatter / all_gather moves
a whole group. (Giving each rank whole tensors instead leaves shards unequal: the
rank that owns the largest layer sets everyone's memory.)

A :class:`FlatLayout` is only that arithmetic: names, shapes, offsets and the shard
this rank owns, fixed once built. What an engine keeps for a bucket from step to step
(the buffers, the optimizer's master shard, gradients) lives in
:class:`zerolearn.engines.base.Bucket`. Gradients are reduced, and under ZeRO-3
parameters gathered, one bucket at a time, so a bucket's size is the fused buffer
size of Sec 6.2.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

# The default bucket policy. On GPUs, torch DDP's: a small first bucket, so that the first
# reduction starts early in backward while NCCL overlaps it with compute, then large ones,
# so that there are few collectives (``DistributedDataParallel(bucket_cap_mb=25)`` and its
# 1 MiB first bucket). On CPUs gloo's collectives run on the same cores as backward, so
# starting one early overlaps nothing and costs a collective: large buckets only.
DEFAULT_BUCKET_MB = 25.0
FIRST_BUCKET_MB = 1.0


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a group sits in a flat buffer, and this rank's shard.

    All sizes are in elements (multiply by the dtype's itemsize for bytes). Build one
    with :meth:`of`; it never changes afterwards.

    Attributes:
        names, shapes: the parameters, in buffer order.
        offsets: start of each parameter in the buffer.
        numel: sum of the parameters' sizes (Psi of this group, unpadded).
        padded_numel: ``numel`` rounded up to a multiple of ``num_shards``.
        shard_numel: ``padded_numel / num_shards``, the same on every rank.
        num_shards: Nd, or 1 when nothing is sharded (DP).
        shard_index: this rank's shard, ``0 <= shard_index < num_shards``.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    num_shards: int
    shard_index: int

    @classmethod
    def of(cls, names: list[str], shapes: list[torch.Size], num_shards: int, shard_index: int) -> FlatLayout:
        """Lay out tensors of ``shapes`` end to end, padded to ``num_shards`` equal shards."""
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += math.prod(shape)
        padded = math.ceil(total / num_shards) * num_shards  # zeros at the end make shards equal
        return cls(tuple(names), tuple(torch.Size(s) for s in shapes), tuple(offsets), total, padded,
                   padded // num_shards, num_shards, shard_index)

    @property
    def padding(self) -> int:
        """Zero elements appended so the buffer divides into equal shards."""
        return self.padded_numel - self.numel

    @property
    def shard_range(self) -> tuple[int, int]:
        """``(start, end)``: the elements of the buffer this rank's shard holds."""
        start = self.shard_index * self.shard_numel
        return start, start + self.shard_numel

    @property
    def label(self) -> str:
        """A short name for messages: ``bucket[first..last]`` parameter names."""
        return f"bucket[{self.names[0]}..{self.names[-1]}]"

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new buffer (``padded_numel``,) of ``dtype`` holding ``tensors``' values (padding 0)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for view, t in zip(self.views(flat), tensors, strict=True):
            view.copy_(t.detach().reshape(view.shape))
        return flat

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        """Each parameter's number of elements, in buffer order."""
        return tuple(math.prod(s) for s in self.shapes)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (``padded_numel``,) shaped as each parameter, no copies.

        One ``split_with_sizes`` cuts every parameter's run at once (a bucket's hooks
        ask for all its views each step); a ``flat`` that autograd tracks is cut one
        view at a time, since views from one multi-output op may not be written in place.
        """
        if flat.requires_grad or not self.names:
            return [self.view_of(flat, i) for i in range(len(self.names))]
        parts = flat[:self.numel].split_with_sizes(self.numels)
        return [part.view(shape) for part, shape in zip(parts, self.shapes, strict=True)]

    def view_of(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """The view of parameter ``index`` inside ``flat``."""
        o, s = self.offsets[index], self.shapes[index]
        return flat[o:o + math.prod(s)].view(s)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``flat``: a view of ``shard_numel`` elements."""
        a, b = self.shard_range
        return flat[a:b]

    def bind(self, params: list[nn.Parameter], flat: torch.Tensor) -> None:
        """Point every parameter's ``.data`` at its view of ``flat`` (shares memory)."""
        for p, view in zip(params, self.views(flat), strict=True):
            p.data = view


def bucket_caps(bucket_mb: float | None, device_type: str = "cuda") -> tuple[int, int]:
    """``(first bucket, other buckets)`` caps in bytes for the option ``bucket_mb`` (MiB).

    None is the default policy: :data:`DEFAULT_BUCKET_MB` for every bucket, and on a GPU
    (``device_type`` other than ``"cpu"``) :data:`FIRST_BUCKET_MB` for the first, as torch
    DDP does. A number caps every bucket at that size.
    """
    if bucket_mb is None:
        first = DEFAULT_BUCKET_MB if device_type == "cpu" else FIRST_BUCKET_MB
        return int(first * 2**20), int(DEFAULT_BUCKET_MB * 2**20)
    return int(bucket_mb * 2**20), int(bucket_mb * 2**20)


def buckets(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int,
            element_size: int, first_bucket_bytes: int | None = None) -> list[list[tuple[str, nn.Parameter]]]:
    """Split parameters, in the given order, into runs of at most ``bucket_bytes``
    (the first run: at most ``first_bucket_bytes``, if given).

    A parameter is never split, so a single parameter larger than the cap forms a
    bucket of its own (the only way a bucket exceeds the cap).
    """
    out, current, size = [], [], 0
    for name, p in named_params:
        nbytes = p.numel() * element_size
        cap = first_bucket_bytes if not out and first_bucket_bytes is not None else bucket_bytes
        if current and size + nbytes > cap:
            out.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        out.append(current)
    return out


def make_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int, element_size: int,
                 num_shards: int, shard_index: int, first_bucket_bytes: int | None = None) -> list[FlatLayout]:
    """The layouts of :func:`buckets`' runs, each padded to ``num_shards`` equal shards.

    Args:
        named_params: ``(name, parameter)`` in the order buffers are laid out.
        bucket_bytes: the cap on a bucket, bytes (a larger parameter is a bucket alone).
        element_size: bytes per element of the working dtype.
        num_shards: Nd (1 when nothing is sharded); shard_index: this rank's shard.
        first_bucket_bytes: the cap on the first bucket, bytes (None: ``bucket_bytes``).
    """
    return [FlatLayout.of([n for n, _ in b], [p.shape for _, p in b], num_shards, shard_index)
            for b in buckets(named_params, bucket_bytes, element_size, first_bucket_bytes)]
