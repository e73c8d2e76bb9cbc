"""Exercise ``05.tensor_parallel``'s check: Megatron's column- and row-parallel Linear layers
(paper Sec 8; Shoeybi et al. 2019).

The trial splits an MLP block (Linear(16, 32), GELU, Linear(32, 16)) over tensor-parallel
groups of Nm = 2 ranks: on 2 ranks one group, on 4 ranks Nd x Nm = 2 x 2, each group on
its own slice of the batch. For three steps it checks what each rank keeps (its rows of
the first layer, its columns of the second, the whole second bias), the block's output
and the input's and every kept parameter's gradient against the whole block in one
process, and the all-reduces booked in ``comm.LEDGER`` (torch's collectives, watched by
:func:`zerolearn.watch.watching` while the trial runs): one of (batch, 16) in forward and
one in backward.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch05.tensor_parallel`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch05.tensor_parallel import tensor_parallel
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, first_difference, register
from zerolearn.residual.tensor_parallel import make_parallel_groups

NM, D, H, BATCH, STEPS = 2, 16, 32, 6, 3


def _block() -> tuple[nn.Linear, nn.Linear]:
    """The whole block's two layers, the same on every rank (one seed); biases nonzero."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(D, H), nn.Linear(H, D)


def _kept(module: nn.Module, what: str, weight: tuple, bias: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The (weight, bias) a layer keeps, or :class:`Wrong` naming the shapes expected."""
    params = list(module.parameters()) if isinstance(module, nn.Module) else []
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() == 1]
    if len(mats) != 1 or len(vecs) != 1:
        raise Wrong(f"the {what} layer must be an nn.Module with two parameters, a weight {weight} and a bias "
                    f"{bias}; it has {[tuple(p.shape) for p in params]}")
    w, b = mats[0], vecs[0]
    if tuple(w.shape) != weight:
        split = "output features: rows" if what == "column-parallel" else "input features: columns"
        raise Wrong(f"the {what} layer's weight has shape {tuple(w.shape)}; it keeps 1/Nm of the {split} of the "
                    f"whole weight, shape {weight}: the wrong dimension is split")
    if tuple(b.shape) != bias:
        why = ("split the bias with the weight's rows: each rank adds its own output features' bias"
               if what == "column-parallel" else "the row-parallel layer keeps the whole bias")
        raise Wrong(f"the {what} layer's bias has shape {tuple(b.shape)}, expected {bias}: {why}")
    return w, b


def _tp_trial(fn) -> str:
    """Three forward and backward passes of the split block against the whole block in one process."""
    groups = make_parallel_groups(NM)
    fc, proj = _block()
    column, row = fn(fc, proj, groups.mp_group, NM, groups.mp_rank)
    mine = slice(groups.mp_rank * H // NM, (groups.mp_rank + 1) * H // NM)
    cw, cb = _kept(column, "column-parallel", (H // NM, D), (H // NM,))
    rw, rb = _kept(row, "row-parallel", (D, H // NM), (D,))
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + groups.dp_rank)  # a slice of the batch per group
        x = torch.randn(BATCH, D, generator=gen, requires_grad=True)
        weights = torch.randn(BATCH, D, generator=gen)
        xr = x.detach().clone().requires_grad_()
        want = proj(F.gelu(fc(xr)))
        comm.LEDGER.reset()
        out = row(F.gelu(column(x)))
        forward = comm.LEDGER.as_dict()["all_reduce"]
        if forward["calls"] != 1 or forward["elements"] != BATCH * D:
            raise Wrong(f"the forward made {forward['calls']} all-reduces of {forward['elements']:,} elements; the "
                        f"block makes one, of the row-parallel layer's partial outputs ({BATCH} x {D}): the "
                        "column-parallel layer's autograd function is the identity in forward (its input is "
                        "already the same on every rank)", step)
        if isinstance(out, torch.Tensor) and out.shape == want.shape and \
                torch.allclose(out, want + (NM - 1) * proj.bias, atol=1e-5):
            raise Wrong(f"the block's output is the whole block's plus {NM - 1} more times the second bias: the "
                        f"row-parallel layer's bias was added on every rank before the all-reduce, which counts it "
                        f"Nm = {NM} times; add it once, after the sum", step)
        first_difference("the block's output", out, want.detach(), step=step, reference="the whole block")
        comm.LEDGER.reset()
        (out * weights).sum().backward()
        (want * weights).sum().backward()
        backward = comm.LEDGER.as_dict()["all_reduce"]
        if backward["calls"] != 1:
            raise Wrong(f"the backward made {backward['calls']} all-reduces; the block makes one, of the input's "
                        "gradient in the column-parallel layer: the row-parallel layer's autograd function is the "
                        "identity in backward (all-reduce in one direction each)", step)
        first_difference("the gradient of the block's input", x.grad, xr.grad, step=step, reference="the whole block")
        for what, got, full in (("the column-parallel weight", cw.grad, fc.weight.grad[mine]),
                                ("the column-parallel bias", cb.grad, fc.bias.grad[mine]),
                                ("the row-parallel weight", rw.grad, proj.weight.grad[:, mine]),
                                ("the row-parallel bias", rb.grad, proj.bias.grad)):
            if got is None:
                raise Wrong(f"{what} got no gradient: keep it as an nn.Parameter and use it in forward", step)
            first_difference(f"the gradient of {what}", got, full, step=step, reference="the whole block's slice")
        for p in (*column.parameters(), *row.parameters(), fc.weight, fc.bias, proj.weight, proj.bias):
            p.grad = None
        agree(step)
    ctx = zdist.context()
    return (f"{STEPS} passes on {ctx.world_size // NM} x {NM} ranks (Nd x Nm): output and every gradient equal the "
            f"whole block; one all-reduce of {BATCH} x {D} in forward and one in backward")


_both_ways = edited(tensor_parallel, {
    "def forward(ctx, x):\n            return x\n":
    "def forward(ctx, x):\n            x = x.clone()\n            dist.all_reduce(x, group=group)\n"
    "            return x\n",
    "def backward(ctx, grad):\n            return grad\n":
    "def backward(ctx, grad):\n            grad = grad.contiguous()\n            dist.all_reduce(grad, group=group)\n"
    "            return grad\n"},
    name="_both_ways",
    doc="""Both autograd functions all-reduce in forward and in backward: the column's input is summed
    Nm times over, and so is the row's output gradient.""")

_bias_on_every_rank = edited(
    tensor_parallel, {"ReduceFromParallel.apply(F.linear(x, self.weight)) + self.bias":
                      "ReduceFromParallel.apply(F.linear(x, self.weight, self.bias))"},
    name="_bias_on_every_rank",
    doc="The row-parallel layer's bias inside F.linear, before the all-reduce: every rank adds it.")

_bias_not_split = edited(
    tensor_parallel, {"nn.Parameter(fc.bias.detach()[mine].clone())": "nn.Parameter(fc.bias.detach().clone())"},
    name="_bias_not_split", doc="The column-parallel layer's weight split by rows, its bias kept whole.")

_wrong_dimension = edited(
    tensor_parallel, {"fc.weight.detach()[mine].clone())  # output features: rows":
                      "fc.weight.detach()[:, rank * fc.in_features // nm:(rank + 1) * fc.in_features // nm].clone())"},
    name="_wrong_dimension",
    doc="The column-parallel weight split by columns (input features), as the row-parallel one is.")


register(Exercise(
    "05.tensor_parallel", "Tensor parallelism: Megatron's column- and row-parallel Linear layers",
    tensor_parallel, _tp_trial,
    {"all_reduce_both_ways": Bug(_both_ways, "an all-reduce in forward and in backward of both functions, "
                                 "instead of one direction each", "the identity in forward"),
     "bias_on_every_rank": Bug(_bias_on_every_rank, "the row-parallel bias added before the all-reduce",
                               "added on every rank"),
     "bias_not_split": Bug(_bias_not_split, "the column-parallel bias left whole", "split the bias"),
     "wrong_dimension": Bug(_wrong_dimension, "the column-parallel weight split along its input features",
                            "the wrong dimension is split")},
    world_sizes=(2, 4)))
