"""Chapter 4, ZeRO-3 (P_os+g+p): what the notebook runs and measures.

* :func:`free_by_reassigning_data` and :func:`free_by_resizing_storage` free a
  gathered weight two ways while autograd still holds the graph, under the
  :class:`~zerolearn.memory.ledger.MemoryLedger`: the first frees nothing, the second
  frees every byte (the trick :mod:`zerolearn.engines.zero3` uses).
* :func:`all_stages` trains stages 0-3 one after the other on the ranks that
  :func:`zerolearn.dist.launch` spawned (one spawn instead of four).
* :func:`simulate` is ``python -m zerolearn.train --simulate-world-size N`` run in
  this process: rank 0 of N ranks, real shards, no data moved.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn.config import TrainConfig
from zerolearn.memory.ledger import MemoryLedger, category
from zerolearn.train import train, train_here

__all__ = ["all_stages", "free_by_reassigning_data", "free_by_resizing_storage", "simulate"]

WIDTH = 256  # the demo's Linear(WIDTH, WIDTH): 256 x 256 fp32 = 262,144 bytes of weight


def _gathered_linear(ledger: MemoryLedger) -> tuple[nn.Linear, torch.Tensor]:
    """A Linear whose weight is a view of a flat buffer, as ZeRO-3 lays a gathered unit out."""
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH, bias=False)
    with category("params"):  # the unit's flat buffer ("all-gathered" into here)
        full = torch.zeros(WIDTH * WIDTH)
    full.copy_(layer.weight.detach().flatten())
    layer.weight.data = full.view(WIDTH, WIDTH)
    return layer, full


def _gather_and_forward(ledger: MemoryLedger, x: torch.Tensor):
    """Gather the demo layer and run its forward on ``x`` [4, WIDTH] under ``ledger``.

    Returns (layer, flat buffer, output, ``seen``: the ledger's ``params`` bytes after
    the gather and after forward).
    """
    layer, full = _gathered_linear(ledger)
    seen = {"gathered": ledger.live["params"]}
    with ledger.phase("forward"):
        y = layer(x)
    seen["after forward"] = ledger.live["params"]
    return layer, full, y, seen


def free_by_reassigning_data() -> dict[str, int]:
    """The pitfall: "free" a gathered weight by reassigning ``.data`` while a graph is alive.

    A Linear's forward saves its weight (a view of the same storage) for backward.
    Reassigning ``weight.data`` and dropping our own reference to the flat buffer
    changes which tensor the *parameter* points at, but the view autograd saved still
    holds the old storage: the ledger shows the bytes alive until the graph itself is
    released. Returns the ledger's ``params`` bytes at each point.
    """
    with MemoryLedger() as ledger:
        layer, full, y, seen = _gather_and_forward(ledger, torch.randn(4, WIDTH, requires_grad=True))
        layer.weight.data = torch.empty(0)  # "free" the unit...
        del full  # ...and drop the engine's own reference to its buffer
        seen["after 'free'"] = ledger.live["params"]
        del y  # only releasing the graph lets the storage go
        seen["after the graph is released"] = ledger.live["params"]
    return seen


def free_by_resizing_storage() -> dict[str, int]:
    """ZeRO-3's way: resize the flat buffer's storage to 0 bytes, then back before backward.

    Every view of the storage (the parameter's, autograd's saved one) keeps pointing
    at it, so nothing else holds the bytes: they are gone at once. Re-growing the
    storage and re-filling it (ZeRO-3 all-gathers into it) lets backward run with
    the same graph. Returns the ledger's ``params`` bytes at each point, and
    ``x_grad_sum``, the sum of the input's gradient, to show backward really ran.
    """
    x = torch.ones(4, WIDTH, requires_grad=True)
    with MemoryLedger() as ledger:
        layer, full, y, seen = _gather_and_forward(ledger, x)
        values = full.clone()  # stands for the shards the next all_gather brings back
        full.untyped_storage().resize_(0)  # free: the storage now holds 0 bytes
        seen["after free"] = ledger.live["params"]
        full.untyped_storage().resize_(WIDTH * WIDTH * full.element_size())
        full.copy_(values)  # "gathered again" before backward
        seen["gathered again"] = ledger.live["params"]
        with ledger.phase("backward"):
            y.sum().backward()
        seen["x_grad_sum"] = round(x.grad.sum().item(), 4)
    return seen


def all_stages(config: TrainConfig, stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    """Train each of ``stages`` in turn on this process group, otherwise with ``config``.

    Runs on every rank spawned by :func:`zerolearn.dist.launch`; returns the reports
    of :func:`zerolearn.train.train` (docs/ARCHITECTURE.md, "The training run"), one per stage, in order.
    """
    return [train(config.replace(stage=stage)) for stage in stages]


def simulate(stage: int, nd: int, config: TrainConfig) -> dict:
    """``python -m zerolearn.train --stage S --simulate-world-size ND ...`` in this process.

    This process plays rank 0 of ``nd`` ranks on torch's "fake" process group: every
    flat buffer is padded and sharded for ``nd`` ranks, so the bytes measured are
    those rank 0 of a real ``nd``-rank job would hold; collectives move no data, so
    the losses mean nothing. Returns the training report (``ranks`` holds rank 0).
    """
    return train_here(config.replace(stage=stage, simulate_world_size=nd))

