"""Exercise ``02.zero1_step``'s check: one ZeRO-1 (P_os) step on a flat gradient (paper Sec 5.1, Sec 7.2.1).

Reduce-scatter, Adam on this rank's fp32 master shard, all-gather of the updated
parameters. The trial trains a small GPT whose parameters are views of one flat padded
buffer for three steps against single-process Adam on the whole batch, and checks the
gradient shard each rank stepped with, every parameter, the ledger's 2 Psi per step
and the optimizer state the rank keeps (at most K Psi / Nd bytes).

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch02.zero1_step`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch02.zero1_step import zero1_step
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, register
from zerolearn.exercises.helpers import (
    batches,
    compare_grad,
    compare_params,
    gpt_pair,
    loss_of,
    psi_per_step,
    reference_grads,
)
from zerolearn.flat import FlatLayout
from zerolearn.tables import kib

STEPS = 3
K = 12  # bytes per shard element a rank may keep: fp32 master 4 + Adam's moments 4 + 4
LR = 7e-4  # the learning rate passed as lr: no torch optimizer's default, so an optimizer built without it shows


def _kept_bytes(state, skip: set[int]) -> int:
    """Bytes of the tensors reachable from ``state`` (optimizers' state and parameters
    included, gradients not), each storage once, storages in ``skip`` and scalars left out."""
    seen, total, stack, visited = set(skip), 0, [state], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = obj.untyped_storage().data_ptr()
            if obj.numel() > 1 and key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [v for s in obj.state.values() for v in s.values()]
            stack += [p for g in obj.param_groups for p in g["params"]]
        elif isinstance(obj, nn.Module):
            stack += list(obj.parameters()) + list(obj.buffers())
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack += list(obj)
    return total


def _optimizers(state) -> list[torch.optim.Optimizer]:
    """The torch optimizers reachable from ``state`` (dicts, lists and tuples searched)."""
    found, stack, seen = [], [state], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
    return found


def _check_optimizers(state, step: int) -> None:
    """A torch optimizer kept in ``state`` must step as single-process Adam at the given lr:
    plain Adam (not AdamW, no weight decay, no amsgrad) with ``lr`` the argument, not a default."""
    for opt in _optimizers(state):
        name = type(opt).__name__
        for group in opt.param_groups:
            decoupled = group.get("decoupled_weight_decay", False) or isinstance(opt, torch.optim.AdamW)
            if not isinstance(opt, torch.optim.Adam) or decoupled:
                what = "AdamW (its weight decay is decoupled from the gradient)" if decoupled else name
                raise Wrong(f"your optimizer is {what}, single-process training here is torch.optim.Adam: ZeRO-1 "
                            "must step as the optimizer it partitions, so build torch.optim.Adam(..., lr=lr) "
                            "over your master shard", step)
            if group["lr"] != LR:
                default = " (Adam's default: was lr=lr forgotten?)" if group["lr"] == 1e-3 else ""
                raise Wrong(f"your optimizer's learning rate is {group['lr']:g}{default}; the step must use the lr "
                            f"argument, {LR:g}: torch.optim.Adam(..., lr=lr)", step)
            if group.get("weight_decay", 0) or group.get("amsgrad", False):
                raise Wrong(f"your Adam has weight_decay={group.get('weight_decay', 0):g}, "
                            f"amsgrad={group.get('amsgrad', False)}; single-process training uses neither", step)


def _zero1_trial(fn) -> str:
    """Three steps of a GPT whose parameters are views of one flat padded buffer, against
    single-process Adam on the whole batch: the gradient shard each rank stepped with,
    the traffic (2 Psi), every parameter, and the optimizer state kept (K Psi / Nd)."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, ref = gpt_pair()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    psi = sum(p.numel() for p in params)
    layout = FlatLayout.of([n for n, _ in named], [p.shape for p in params], ws, rank)

    def flat(tensors) -> torch.Tensor:
        return layout.flatten(tensors, torch.float32, torch.device("cpu"))

    flat_params = flat(params)
    layout.bind(params, flat_params)
    state: dict = {}
    limit = K * layout.shard_numel
    for step in range(STEPS):
        local = layout.shard_of(flat(reference_grads(ref, step)))
        want = layout.shard_of(flat([q.grad for q in ref.parameters()]))
        (x, y), _ = batches(step)
        loss_of(model, x, y).backward()
        flat_grad = flat([p.grad for p in params])
        for p in params:
            p.grad = None
        before = layout.shard_of(flat_params).clone()
        comm.LEDGER.reset()
        got = fn(flat_params, flat_grad, state, ws, rank, LR)
        compare_grad("the gradient shard you stepped with (your return value)", got, want, local, before, ws, step)
        _check_optimizers(state, step)
        moved = comm.LEDGER.volume_elements()
        if moved == 0:
            raise Wrong("comm.LEDGER saw no collective: call comm.reduce_scatter and comm.all_gather "
                        "(they book what moves), not torch.distributed directly", step)
        if moved != 2 * layout.padded_numel:
            raise Wrong(f"you moved {psi_per_step(moved, psi)} per step; ZeRO-1 moves 2.0 Psi (a reduce-scatter "
                        "of the gradients and an all-gather of the updated parameters, Sec 7.2.1)", step)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        compare_params(model, ref, step)
        kept = _kept_bytes(state, {flat_params.untyped_storage().data_ptr(), flat_grad.untyped_storage().data_ptr()})
        if kept == 0:
            raise Wrong("`state` holds no tensor after the step: keep this rank's master shard and its Adam "
                        "in it, so that they persist from step to step", step)
        if kept > limit:
            raise Wrong(f"you keep {kib(kept, unit=True)} of optimizer states; ZeRO-1 keeps at most "
                        f"{kib(limit, unit=True)}: an fp32 master copy and Adam's two moments for this rank's "
                        f"{layout.shard_numel:,} elements only, K Psi / Nd bytes with K = {K} (Sec 5.1)", step)
        agree(step)
    return (f"gradient shards and parameters equal single-process Adam for {STEPS} steps; 2.0 Psi per step; "
            f"{kib(kept, unit=True)} of optimizer states on this rank, K Psi / Nd for Psi = {psi:,} "
            f"(+ {layout.padding} padding) on {ws} ranks")


def _allreduce_then_broadcast(flat_params, flat_grad, state, world_size, rank, lr):
    """Seed 002 (the blog reproduction this book starts from): every gradient is
    all-reduced (2 Psi), the owner steps its shard, then each owner broadcasts its
    updated parameters (Psi more): 3 Psi per step for the numbers of 2 Psi."""
    shard = flat_params.numel() // world_size
    if not state:
        state["master"] = nn.Parameter(flat_params[rank * shard:(rank + 1) * shard].clone())
        state["adam"] = torch.optim.Adam([state["master"]], lr=lr)
    master, adam = state["master"], state["adam"]
    comm.all_reduce(flat_grad)
    grad = flat_grad[rank * shard:(rank + 1) * shard] / world_size
    master.grad = grad
    adam.step()
    master.grad = None
    flat_params[rank * shard:(rank + 1) * shard].copy_(master.detach())
    for owner in range(world_size):
        comm.broadcast(flat_params[owner * shard:(owner + 1) * shard], src=owner)
    return grad


def _whole_model_state(flat_params, flat_grad, state, world_size, rank, lr):
    """Every rank keeps an fp32 master and Adam's moments for the whole model and steps all
    of it: DP's optimizer, the redundancy ZeRO-1 exists to remove (Sec 4, Sec 5.1)."""
    shard = flat_params.numel() // world_size
    if not state:
        state["master"] = nn.Parameter(flat_params.clone())
        state["adam"] = torch.optim.Adam([state["master"]], lr=lr)
    master, adam = state["master"], state["adam"]
    grad = torch.empty(shard)
    comm.reduce_scatter(grad, flat_grad)
    grad.div_(world_size)
    full = torch.empty_like(flat_grad)
    comm.all_gather(full, grad)
    master.grad = full
    adam.step()
    master.grad = None
    flat_params.copy_(master.detach())
    return grad


def _average_twice(flat_params, flat_grad, state, world_size, rank, lr):
    """Nd divided out before the sum (as engines do, to keep fp16 sums finite) and again
    after it. Adam's update barely changes with the gradient's scale, so only the
    gradient itself shows the mistake."""
    shard = flat_params.numel() // world_size
    if not state:
        state["master"] = nn.Parameter(flat_params[rank * shard:(rank + 1) * shard].clone())
        state["adam"] = torch.optim.Adam([state["master"]], lr=lr)
    master, adam = state["master"], state["adam"]
    grad = torch.empty(shard)
    comm.reduce_scatter(grad, flat_grad / world_size)
    grad.div_(world_size)
    master.grad = grad
    adam.step()
    master.grad = None
    comm.all_gather(flat_params, master.detach())
    return grad


def _zero1_with(optimizer, flat_params, flat_grad, state, world_size, rank):
    """The reference step with another optimizer over the master shard (``optimizer(params)``)."""
    shard = flat_params.numel() // world_size
    if not state:
        state["master"] = nn.Parameter(flat_params[rank * shard:(rank + 1) * shard].clone())
        state["adam"] = optimizer([state["master"]])
    master, adam = state["master"], state["adam"]
    grad = torch.empty(shard)
    comm.reduce_scatter(grad, flat_grad)
    grad.div_(world_size)
    master.grad = grad
    adam.step()
    master.grad = None
    comm.all_gather(flat_params, master.detach())
    return grad


def _default_lr(flat_params, flat_grad, state, world_size, rank, lr):
    """torch.optim.Adam built without ``lr=``: it steps at its default, 1e-3, whatever lr says."""
    return _zero1_with(torch.optim.Adam, flat_params, flat_grad, state, world_size, rank)


def _adamw(flat_params, flat_grad, state, world_size, rank, lr):
    """AdamW for Adam: its decoupled weight decay (0.01 by default) moves every parameter a little
    more than single-process Adam does, too little to see in one step's parameters."""
    return _zero1_with(lambda params: torch.optim.AdamW(params, lr=lr), flat_params, flat_grad, state,
                       world_size, rank)


def _extra_gather_on_one_rank(flat_params, flat_grad, state, world_size, rank, lr):
    """The reference step, then on the last rank only one more all-gather (a debugging gather left
    in under ``if rank == ...``): its peers never call it, so that rank waits in it for ever."""
    grad = zero1_step(flat_params, flat_grad, state, world_size, rank, lr)
    if rank == world_size - 1:
        comm.all_gather(flat_params, state["master"].detach())
    return grad


register(Exercise(
    "02.zero1_step", "ZeRO-1: reduce-scatter, update this rank's shard, all-gather",
    zero1_step, _zero1_trial,
    {"allreduce_then_broadcast": Bug(_allreduce_then_broadcast, "seed 002, the blog's ShardedOptimizer",
                                     "ZeRO-1 moves 2.0 Psi"),
     "whole_model_state": Bug(_whole_model_state, "DP's optimizer kept on every rank", "KiB of optimizer states"),
     "average_twice": Bug(_average_twice, "dividing by Nd before and after the sum", "divided twice"),
     "default_lr": Bug(_default_lr, "an optimizer built without lr= (a test at Adam's default lr cannot see it)",
                       "(Adam's default"),
     "adamw": Bug(_adamw, "torch.optim.AdamW for Adam: the names differ by one letter", "your optimizer is AdamW"),
     "extra_gather_on_one_rank": Bug(_extra_gather_on_one_rank, "a collective under `if rank == ...`: one rank "
                                     "waits in it, its peers never call it", "never call")}))
