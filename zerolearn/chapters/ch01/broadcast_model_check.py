"""Exercise ``01.broadcast_model``'s check: DDP's start-up broadcast (paper Sec 2.1).

Data parallelism needs identical replicas. Building the model from one seed on every rank
gives them (the book's engines do that); torch's DDP instead broadcasts rank 0's
parameters and buffers when it wraps a model. The trial builds a small BatchNorm network
from another seed on every rank (so every parameter and buffer differs, the int64
``num_batches_tracked`` included), builds an optimizer over it, calls the reader's function,
and compares every tensor with rank 0's (which each rank can rebuild from rank 0's seed),
checks that rank 0's are untouched and that the tensors are the same ones (the optimizer's),
and reads the ledger: one broadcast's worth of every element, Psi plus the buffers.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch01.broadcast_model`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch01.broadcast_model import broadcast_model
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, first_difference, register, unchanged


def _network(seed: int) -> nn.Module:
    """A small BatchNorm network whose every parameter and buffer depends on ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    bn = model[1]
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    bn.num_batches_tracked.fill_(seed + 1)
    return model


def _broadcast_trial(fn) -> str:
    """Every rank's network becomes rank 0's, in place; rank 0's is unchanged; every element
    moved once."""
    rank = zdist.context().rank
    model, want = _network(seed=rank), _network(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before, as a user's loop does
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    storage = {name: t.data_ptr() for name, t in model.state_dict().items()}
    comm.LEDGER.reset()
    fn(model)
    elements = sum(t.numel() for t in model.state_dict().values())
    psi = sum(p.numel() for p in model.parameters())
    sent = comm.LEDGER.as_dict().get("broadcast", {})
    moved = sent.get("elements", 0)
    if moved == psi < elements:  # the same on every rank, so every rank says it
        raise Wrong(f"your broadcasts moved the {psi} parameter elements and none of the {elements - psi} in "
                    "buffers: a module's state is its parameters and its buffers (BatchNorm's running statistics); "
                    "broadcast model.buffers() too, as DDP does (broadcast_buffers=True)")
    state, wanted = model.state_dict(), want.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    for name, t in state.items():
        if t.data_ptr() != storage[name]:
            raise Wrong(f"{name!r} is a new tensor after your function: write rank 0's values into the model's own "
                        "tensors (dist.broadcast(t, src=0) writes in place); the optimizer built before still "
                        "holds the old ones")
    for name, t in state.items():
        if rank == 0:
            first_difference(f"rank 0's {name!r}", t, before[name], rtol=0, atol=0,
                             reference="rank 0's value before the call (rank 0 sends, it receives nothing)")
            continue
        if torch.equal(t, wanted[name]):
            continue
        if name in buffers and torch.equal(t, before[name]):
            raise Wrong(f"the buffer {name!r} is still this rank's own: a module's state is its parameters and its "
                        "buffers (BatchNorm's running statistics); broadcast model.buffers() too, as DDP does "
                        "(broadcast_buffers=True)")
        unchanged(f"{name!r}", t, before[name], "t")
        first_difference(f"{name!r}", t, wanted[name], rtol=0, atol=0, reference="rank 0's value")
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters(), strict=True))
    if moved != elements:
        raise Wrong(f"your broadcasts moved {moved} elements; the model's parameters and buffers hold {elements}: "
                    "each tensor once")
    return (f"every parameter and buffer equals rank 0's, in place, rank 0's unchanged; {sent['calls']} broadcast "
            f"calls moved {moved} elements (Psi = {psi} plus {moved - psi} in buffers)")


_parameters_only = edited(
    broadcast_model, {"[*model.parameters(), *model.buffers()]": "model.parameters()"}, name="_parameters_only",
    doc="""Only the parameters: BatchNorm's running statistics (buffers) stay each rank's own,
    so the replicas evaluate differently (DDP broadcasts buffers too, broadcast_buffers=True).""")

_into_a_copy = edited(
    broadcast_model, {"dist.broadcast(t.data, src=0)": "dist.broadcast(t.detach().clone(), src=0)"},
    name="_into_a_copy",
    doc="""Broadcast into a copy: every rank receives rank 0's values into a tensor nobody keeps.""")

_own_rank_sends = edited(
    broadcast_model, {"(t.data, src=0)": "(t.data, src=dist.get_rank())"}, name="_own_rank_sends",
    doc="""Every rank names itself the source: each sends, none receives.""")

_rebinds = edited(
    broadcast_model, {"    for t in [*model.parameters(), *model.buffers()]:\n"
                      "        dist.broadcast(t.data, src=0)  # .data: writing into a leaf that requires grad\n":
                      "    for t in [*model.parameters(), *model.buffers()]:\n"
                      "        received = t.detach().clone()\n"
                      "        dist.broadcast(received, src=0)\n"
                      "        t.data = received  # a new tensor behind the parameter's name\n"},
    name="_rebinds",
    doc="""Rank 0's values land in new tensors put behind the module's names (``p.data = ...``):
    an optimizer built before steps the old ones.""")


register(Exercise(
    "01.broadcast_model", "DDP's start-up: every rank gets rank 0's parameters and buffers",
    broadcast_model, _broadcast_trial,
    {"parameters_only": Bug(_parameters_only, "DDP's broadcast_buffers=True", "broadcast model.buffers() too"),
     "into_a_copy": Bug(_into_a_copy, "a received value nobody keeps", "nothing was written into it"),
     "rebinds": Bug(_rebinds, "p.data = ... after the optimizer was built", "is a new tensor"),
     "own_rank_sends": Bug(_own_rank_sends, "src=rank: the sender written as this rank", "broadcast(src=1)")},
    timeout_s=60.0, stepped=False))
