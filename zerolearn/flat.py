"""Flat parameter buffers: many tensors as one, padded and sharded by element.

ZeRO partitions model states by *element*, not by tensor (Sec 5): a group of
parameters is laid end to end in one 1-D buffer, the buffer is padded with zeros
to a multiple of the number of shards, and shard r is the r-th equal slice. Shards
are then equal whatever the layer sizes, and one reduce_scatter / all_gather moves
a whole group. (Giving each rank whole tensors instead leaves shards unequal: the
rank that owns the largest layer sets everyone's memory.)

A :class:`FlatGroup` is also the engines' bucket: gradients are reduced, and under
ZeRO-3 parameters gathered, one group at a time, so a group's size is the fused
buffer size of Sec 6.2.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class FlatGroup:
    """A bucket of parameters laid out as one flat buffer of ``padded_numel`` elements.

    Args:
        names, params: the parameters, in buffer order.
        num_shards: the buffer is padded to a multiple of this (Nd, or 1 for DP).
        shard_index: this rank's shard (0 <= shard_index < num_shards).

    Attributes (all in elements): ``numel`` (sum of the parameters' sizes),
    ``padded_numel`` (multiple of ``num_shards``), ``shard_numel``
    (``padded_numel / num_shards``), ``offsets`` (start of each parameter).
    """

    def __init__(self, names: list[str], params: list[nn.Parameter], num_shards: int, shard_index: int):
        self.names, self.params = names, params
        self.shapes = [p.shape for p in params]
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.padded_numel = math.ceil(total / num_shards) * num_shards
        self.shard_numel = self.padded_numel // num_shards
        self.num_shards, self.shard_index = num_shards, shard_index
        start = shard_index * self.shard_numel
        self.shard_range = (start, start + self.shard_numel)
        # Engine state (None when not held). full: working params, padded_numel
        # elements; shard: working-param shard (ZeRO-3); master: the optimizer's
        # fp32 parameter; grad_full / grad_shard: gradients before / after reduction.
        # reduced: the output of a reduction in flight when it cannot go straight into
        # grad_shard (stage 1 always; stages 2-3 when a previous backward's reduced
        # gradient is being accumulated into).
        self.full = self.shard = self.master = None
        self.grad_full = self.grad_shard = self.reduced = None
        self.ready = 0  # parameters whose gradient has arrived in this backward

    @property
    def padding(self) -> int:
        """Zero elements appended so the buffer divides into equal shards."""
        return self.padded_numel - self.numel

    def flatten(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new buffer (``padded_numel``,) of ``dtype`` holding the parameters' values."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for view, p in zip(self.views(flat), self.params):
            view.copy_(p.detach().reshape(view.shape))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (``padded_numel``,) shaped as each parameter, no copies."""
        return [flat[o:o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes)]

    def view_of(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """The view of parameter ``index`` inside ``flat``."""
        o, s = self.offsets[index], self.shapes[index]
        return flat[o:o + math.prod(s)].view(s)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``flat``: a view of ``shard_numel`` elements."""
        a, b = self.shard_range
        return flat[a:b]

    def bind(self, flat: torch.Tensor) -> None:
        """Point every parameter's ``.data`` at its view of ``flat`` (shares memory)."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view


def make_groups(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int, element_size: int,
                num_shards: int, shard_index: int) -> list[FlatGroup]:
    """Split parameters, in the given order, into groups of at most ``bucket_bytes``.

    A parameter is never split, so a single parameter larger than ``bucket_bytes``
    forms a group of its own (the only way a group exceeds the cap).
    """
    groups, names, params, size = [], [], [], 0
    for name, p in named_params:
        nbytes = p.numel() * element_size
        if params and size + nbytes > bucket_bytes:
            groups.append(FlatGroup(names, params, num_shards, shard_index))
            names, params, size = [], [], 0
        names.append(name)
        params.append(p)
        size += nbytes
    if params:
        groups.append(FlatGroup(names, params, num_shards, shard_index))
    return groups
