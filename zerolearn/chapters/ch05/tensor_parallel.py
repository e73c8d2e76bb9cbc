"""Exercise ``05.tensor_parallel``: Megatron's column- and row-parallel Linear layers (paper
Sec 8, where ZeRO meets model parallelism; Shoeybi et al. 2019).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch05.tensor_parallel_check`; the
package's own version is :mod:`zerolearn.residual.tensor_parallel`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def tensor_parallel(fc, proj, group, nm, rank):
    """Split an MLP's two Linear layers over the Nm ranks of a tensor-parallel ``group``.

    Args:
        fc: ``nn.Linear(d, h)``, fp32, whole; ``h`` divisible by ``nm``.
        proj: ``nn.Linear(h, d)``, fp32, whole.
        group: the process group of the Nm tensor-parallel ranks (pass it to
            ``dist.all_reduce(tensor, group=group)``); they all see the same input.
        nm: the tensor-parallel degree, Nm.
        rank: this rank's place in ``group``, 0 <= rank < nm.

    Returns:
        ``(column, row)``, two ``nn.Module``s such that ``row(F.gelu(column(x)))`` equals
        ``proj(F.gelu(fc(x)))`` on every rank of the group, in forward and in backward:

        * ``column`` keeps rows ``[rank * h / nm, (rank + 1) * h / nm)`` of ``fc.weight``
          and of ``fc.bias`` (its slice of the output features) as its own parameters; its
          input passes through an autograd function that is the identity in forward and
          all-reduces the gradient in backward (each rank's part of the input's gradient);
        * ``row`` keeps the same columns of ``proj.weight`` (its slice of the input
          features) and the whole ``proj.bias``; its partial output goes through an
          autograd function that all-reduces in forward and is the identity in backward,
          and the bias is added once, after the sum.

    One all-reduce of (..., d) in forward and one in backward (Sec 8).
    """
    # BEGIN SOLUTION
    class CopyToParallel(torch.autograd.Function):  # forward: identity; backward: sum over the group
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad

    class ReduceFromParallel(torch.autograd.Function):  # forward: sum over the group; backward: identity
        @staticmethod
        def forward(ctx, x):
            x = x.clone()  # reduced in place: leave autograd's input alone
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    width = fc.out_features // nm
    mine = slice(rank * width, (rank + 1) * width)

    class Column(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(fc.weight.detach()[mine].clone())  # output features: rows
            self.bias = nn.Parameter(fc.bias.detach()[mine].clone())

        def forward(self, x):
            return F.linear(CopyToParallel.apply(x), self.weight, self.bias)

    class Row(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(proj.weight.detach()[:, mine].clone())  # input features: columns
            self.bias = nn.Parameter(proj.bias.detach().clone())  # whole, added once after the sum

        def forward(self, x):
            return ReduceFromParallel.apply(F.linear(x, self.weight)) + self.bias

    return Column(), Row()
    # END SOLUTION
