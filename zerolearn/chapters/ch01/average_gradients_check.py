"""Exercise ``01.average_gradients``'s check: naive data parallelism (paper Sec 2.1, Sec 7.1).

After backward, the reader replaces every gradient by its mean over the ranks, one
all-reduce per tensor. The trial trains a small GPT with Adam for three steps on this
rank's slice of each global batch, beside the same GPT trained in this process on the
whole batch, and compares every gradient (naming the known mistakes: not averaged, the
sum, divided twice) and every parameter, then the 2 Psi per step the ledger books
(torch's collectives, watched by :mod:`zerolearn.watch`).

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch01.average_gradients`.
"""

from __future__ import annotations

import torch

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch01.average_gradients import average_gradients
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, register
from zerolearn.exercises.helpers import (
    ADAM_LR,
    batches,
    compare_grad,
    compare_params,
    gpt_pair,
    loss_of,
    psi_per_step,
    reference_grads,
)

STEPS = 3


def _average_trial(fn) -> str:
    """Three Adam steps of a GPT on this rank's slice against one process on the whole batch:
    every gradient after ``fn``, every parameter after the step, and 2 Psi per step."""
    world_size = zdist.context().world_size
    model, ref = gpt_pair()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR), torch.optim.Adam(ref.parameters(), lr=ADAM_LR)
    psi = sum(p.numel() for p in model.parameters())
    for step in range(STEPS):
        local = reference_grads(ref, step)
        (x, y), _ = batches(step)
        loss_of(model, x, y).backward()
        comm.LEDGER.reset()
        fn(model, world_size)
        for (name, p), q, g in zip(model.named_parameters(), ref.parameters(), local, strict=True):
            compare_grad(f"the gradient of {name!r}", p.grad, q.grad, g, p, world_size, step)
        moved = comm.LEDGER.volume_elements()
        if moved == 0:
            raise Wrong("no collective ran: sum every gradient over the ranks with dist.all_reduce(p.grad)", step)
        if moved != 2 * psi:
            raise Wrong(f"you moved {psi_per_step(moved, psi)} per step; averaging the gradients moves 2.0 Psi "
                        "(one all-reduce of every gradient, Sec 7.1)", step)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        compare_params(model, ref, step)
        agree(step)
    calls = comm.LEDGER.as_dict()["all_reduce"]["calls"]
    return (f"every gradient and parameter equals single-process Adam on the global batch for {STEPS} steps; "
            f"2.0 Psi per step in {calls} all_reduce calls")


_average_the_weights = edited(
    average_gradients, {"dist.all_reduce(p.grad)": "dist.all_reduce(p.data)", "p.grad.div_(": "p.data.div_("},
    name="_average_the_weights",
    doc="""huggingface/picotron issue #39: the reduction is applied to the parameter, not to
    its gradient, so the (identical) weights are averaged and the gradients never are.""")

_sum_not_mean = edited(
    average_gradients, {"            p.grad.div_(world_size)\n": ""}, name="_sum_not_mean",
    doc="""The division by Nd forgotten: every rank steps with Nd times the gradient (a common
    slip in hand-written DP; Adam hides it, SGD does not).""")

_divide_twice = edited(
    average_gradients, {"p.grad.div_(world_size)": "p.grad.div_(world_size).div_(world_size)"}, name="_divide_twice",
    doc="""Nd divided out twice, e.g. once by the loss (``loss / world_size``) and once after the
    all-reduce, as when code written for a summed loss meets a mean loss.""")


register(Exercise(
    "01.average_gradients", "Naive data parallelism: average every gradient over the ranks",
    average_gradients, _average_trial,
    {"weights_not_grads": Bug(_average_the_weights, "huggingface/picotron issue #39", "not averaged over the ranks"),
     "no_divide": Bug(_sum_not_mean, "hand-written DP loops", "not their mean"),
     "divide_twice": Bug(_divide_twice, "a mean loss divided by Nd again", "divided twice")}))
