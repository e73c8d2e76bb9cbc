"""Model parallelism, minimal and real: Megatron-style tensor parallelism over Nm ranks.

ZeRO-R's P_a only makes sense next to model parallelism (MP), where every rank of a
block holds the same activations. This module splits the GPT's attention and MLP
across an Nm-rank group the way Megatron-LM does (Shoeybi et al. 2019; paper Sec 8):

* a *column-parallel* Linear keeps 1/Nm of the output features: its input is the
  same on every rank (forward: nothing to do; backward: all-reduce the input grad);
* a *row-parallel* Linear keeps 1/Nm of the input features: its partial outputs are
  all-reduced in forward (backward: nothing to do); its bias is added once, after.

Attention is column-parallel by heads (q, k and v of H/Nm heads per rank) followed by
a row-parallel output projection; the MLP is column-parallel fc, GELU, row-parallel
out. Two all-reduces of batch x seq x hidden per block in forward and two in backward,
plus as many again when checkpointing recomputes the forward.

The world of Nd x Nm ranks is cut into Nd tensor-parallel groups of Nm adjacent
ranks, and Nm data-parallel groups of the ranks with the same position in theirs;
ZeRO-DP shards over the data-parallel group. Weights are sliced from the full model
built from the same seed, so Nm = 2 starts from exactly the Nm = 1 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerolearn import comm
from zerolearn.errors import ConfigError


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in an Nd x Nm world (ranks r = dp_rank * nm + mp_rank)."""

    nd: int
    nm: int
    dp_rank: int
    mp_rank: int
    dp_group: object
    mp_group: object


def make_parallel_groups(nm: int) -> ParallelGroups:
    """Cut the default world into data- and tensor-parallel groups (a collective).

    Raises:
        ConfigError: ``nm`` < 1 or not a divisor of the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if nm < 1 or world % nm:
        raise ConfigError(f"--tensor-parallel {nm}: must be >= 1 and divide the world size {world}")
    nd = world // nm
    dp_group = mp_group = None
    # Every rank must create every group, in the same order.
    for d in range(nd):
        g = dist.new_group(list(range(d * nm, (d + 1) * nm)))
        if rank // nm == d:
            mp_group = g
    for t in range(nm):
        g = dist.new_group(list(range(t, world, nm)))
        if rank % nm == t:
            dp_group = g
    return ParallelGroups(nd, nm, rank // nm, rank % nm, dp_group, mp_group)


class _CopyToParallel(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group, tag="tp")
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Forward: sum partial outputs over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # reduced in place; leave the input alone
        comm.all_reduce(x, group=group, tag="tp")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """The rows ``index`` of ``full``'s weight (its output features): (..., in) -> (..., len(index))."""

    def __init__(self, full: nn.Linear, index: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[index].clone())
        self.bias = nn.Parameter(full.bias.detach()[index].clone()) if full.bias is not None else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.tensor_parallel = True  # a slice: other ranks of the group hold other slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToParallel.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The columns ``index`` of ``full``'s weight (its input features): (..., len(index)) -> (..., out)."""

    def __init__(self, full: nn.Linear, index: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[:, index].clone())
        self.weight.tensor_parallel = True
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None  # a replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromParallel.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's H / Nm heads (replaces ``models.Attention``)."""

    def __init__(self, full, nm: int, mp_rank: int, group):
        super().__init__()
        d = full.qkv.in_features
        heads, head_dim = full.n_head, d // full.n_head
        self.n_head = heads // nm
        mine = torch.arange(mp_rank * self.n_head, (mp_rank + 1) * self.n_head)
        # qkv's output rows are laid out (3, heads, head_dim): take q, k and v of our heads.
        rows = torch.arange(3 * d).view(3, heads, head_dim)[:, mine].reshape(-1)
        cols = torch.arange(d).view(heads, head_dim)[mine].reshape(-1)
        self.qkv = ColumnParallelLinear(full.qkv, rows, group)
        self.proj = RowParallelLinear(full.proj, cols, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def parallelize_gpt(model: nn.Module, groups: ParallelGroups) -> nn.Module:
    """Split every block of a ``models.GPT`` across the tensor-parallel group, in place.

    Embedding, LayerNorms and head stay whole on every rank: their inputs and
    gradients are identical across the group, so they need no communication.

    Raises:
        ConfigError: heads or MLP width not divisible by Nm.
    """
    nm, r, group = groups.nm, groups.mp_rank, groups.mp_group
    if nm == 1:
        return model
    cfg = model.cfg
    if cfg.n_head % nm:
        raise ConfigError(f"--tensor-parallel {nm}: must divide the GPT's {cfg.n_head} attention heads")
    for block in model.blocks:
        block.attn = ParallelAttention(block.attn, nm, r, group)
        width = block.fc.out_features // nm
        mine = torch.arange(r * width, (r + 1) * width)
        block.fc = ColumnParallelLinear(block.fc, mine, group)
        block.out = RowParallelLinear(block.out, mine, group)
    return model
