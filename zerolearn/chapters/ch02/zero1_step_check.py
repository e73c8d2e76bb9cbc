"""Exercise ``02.zero1_step``'s check: one ZeRO-1 (P_os) step on a flat gradient, in mixed
precision (paper Sec 3.1, Sec 5.1; DP's traffic, Sec 1 and Sec 7).

Reduce-scatter, Adam on this rank's fp32 master shard, all-gather of the updated
parameters. The trial trains a small GPT whose parameters are views of one flat padded
buffer: in fp32 for three steps against single-process Adam on the whole batch (the
gradient shard each rank stepped with, every parameter, the ledger's 2 Psi per step and
the optimizer state kept, at most K Psi / Nd bytes), then one step each as ZeRO-2
(``reduced=True``) and ZeRO-3 (``gather=False``) call it; then in bf16 for three steps,
where the gradient shard is compared with the exact mean of the ranks' bf16 gradients
and the fp32 master with fp32 Adam stepped with that gradient, so that a master kept in
bf16 or refreshed from the bf16 parameters shows.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch02.zero1_step`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch02.zero1_step import zero1_step
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, first_difference, register, unchanged
from zerolearn.exercises.helpers import (
    PARAM_ATOL,
    PARAM_RTOL,
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


def _reachable(state, into_optimizers: bool = False):
    """Every object reachable from ``state`` through dicts, lists and tuples, each once
    (``into_optimizers``: also an optimizer's parameters and state tensors)."""
    stack, seen = [state], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if into_optimizers and isinstance(obj, torch.optim.Optimizer):
            stack += [v for s in obj.state.values() for v in s.values()]
            stack += [p for g in obj.param_groups for p in g["params"]]
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)


def _optimizers(state) -> list[torch.optim.Optimizer]:
    """The torch optimizers reachable from ``state`` (dicts, lists and tuples searched)."""
    return [obj for obj in _reachable(state) if isinstance(obj, torch.optim.Optimizer)]


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


def _masters(state, n: int) -> list[torch.Tensor]:
    """The fp32 tensors of ``n`` elements reachable from ``state`` (optimizers' parameters and
    state included): the candidates for the fp32 master of a shard of ``n`` elements."""
    return [obj.detach() for obj in _reachable(state, into_optimizers=True)
            if isinstance(obj, torch.Tensor) and obj.dtype == torch.float32 and obj.numel() == n]


def _check_mixed_precision(state, want_master: torch.Tensor, step: int) -> None:
    """In bf16, the optimizer must step an fp32 master that keeps its precision from step to step:
    ``want_master`` is the trial's own fp32 Adam, stepped with the gradient the reader returned."""
    for opt in _optimizers(state):
        low = sorted({str(p.dtype) for g in opt.param_groups for p in g["params"] if p.dtype != torch.float32})
        if low:
            raise Wrong(f"in bf16: your optimizer steps {', '.join(low)} tensors; mixed precision keeps an fp32 "
                        "master of the shard and steps that (an update smaller than a bf16 parameter's last bit "
                        "would be lost), then casts it back into the bf16 parameters", step)
    masters = _masters(state, want_master.numel())
    if not masters:
        raise Wrong(f"in bf16: `state` holds no fp32 tensor of this rank's {want_master.numel():,} elements: keep an "
                    "fp32 master copy of the shard from step to step (4 of K = 12 bytes per element, Sec 3.1)", step)
    if not any(torch.allclose(m, want_master, rtol=1e-5, atol=1e-7) for m in masters):
        raise Wrong("in bf16: your fp32 master differs from fp32 Adam stepped with the gradient you returned "
                    "(it lost the precision bf16 does not have): keep the master from step to step and never "
                    "copy it back from the bf16 parameters", step)


def _bf16_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elements where a bf16 sum ``got`` is farther from the exact ``want`` than bf16's rounding
    of the addends (``scale``: the sum of their magnitudes) explains."""
    return (got.double() - want).abs() > 2.0 ** -7 * scale + 1e-12


def _setup(ws: int, rank: int, dtype: torch.dtype):
    """The rank's GPT (parameters views of one flat padded buffer of ``dtype``), its reference, the layout."""
    model, ref = gpt_pair()
    model.to(dtype)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    layout = FlatLayout.of([n for n, _ in named], [p.shape for p in params], ws, rank)
    flat_params = layout.flatten(params, dtype, torch.device("cpu"))
    layout.bind(params, flat_params)
    return model, ref, params, layout, flat_params


def _zero1_trial(fn) -> str:
    """Steps of a GPT whose parameters are views of one flat padded buffer: in fp32 against
    single-process Adam on the whole batch (the gradient shard each rank stepped with, the
    traffic (2 Psi), every parameter, the optimizer state kept (K Psi / Nd)), also as ZeRO-2
    and ZeRO-3 call it (``reduced``, ``gather``); then in bf16 against the ranks' exact mean
    gradient and fp32 Adam on the master shard."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, ref, params, layout, flat_params = _setup(ws, rank, torch.float32)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    psi = layout.numel

    def flat(tensors, dtype=torch.float32) -> torch.Tensor:
        return layout.flatten(tensors, dtype, torch.device("cpu"))

    state: dict = {}
    limit = K * layout.shard_numel
    kept = 0
    for step in range(STEPS + 2):
        # Steps 0-2: ZeRO-1. Step 3: as ZeRO-2 calls it (the gradient already reduced); step 4:
        # as ZeRO-3 calls it (the shard of the parameters alone, nothing gathered).
        reduced, gather = step >= STEPS, step < STEPS + 1
        local = layout.shard_of(flat(reference_grads(ref, step)))
        want = layout.shard_of(flat([q.grad for q in ref.parameters()]))
        (x, y), _ = batches(step)
        loss_of(model, x, y).backward()
        flat_grad = flat([p.grad for p in params])
        for p in params:
            p.grad = None
        before = layout.shard_of(flat_params).clone()
        if reduced:  # what ZeRO-2's hooks hand over: this rank's averaged shard
            shard = torch.empty(layout.shard_numel)
            comm.reduce_scatter(shard, flat_grad)
            flat_grad = shard / ws
        target = flat_params if gather else layout.shard_of(flat_params).clone()
        target_before = target.clone()
        comm.LEDGER.reset()
        how = "" if not reduced else " with reduced=True" if gather else " with reduced=True, gather=False"
        got = fn(flat_params, flat_grad, state, ws, rank, LR) if not reduced else \
            fn(target, flat_grad, state, ws, rank, LR, reduced=True, gather=gather)
        compare_grad(f"the gradient shard you stepped with (your return value{how})", got, want, local, before, ws,
                     step)
        _check_optimizers(state, step)
        moved = comm.LEDGER.volume_elements()
        if moved == 0 and not reduced:
            raise Wrong("no collective ran: reduce-scatter the gradient with dist.reduce_scatter_single and "
                        "all-gather the updated shards with dist.all_gather_single", step)
        if not reduced and moved != 2 * layout.padded_numel:
            raise Wrong(f"you moved {psi_per_step(moved, psi)} per step; ZeRO-1 moves 2.0 Psi (a reduce-scatter "
                        "of the gradients and an all-gather of the updated parameters: DP's volume, Sec 1, Sec 7)",
                        step)
        if reduced and moved != (layout.padded_numel if gather else 0):
            expected = "the all-gather alone, 1.0 Psi" if gather else "nothing: ZeRO-3 gathers parameters when " \
                "a unit needs them"
            raise Wrong(f"with reduced=True{'' if gather else ', gather=False'} you moved {psi_per_step(moved, psi)}; "
                        f"the gradient is already reduced, so the step moves {expected}", step)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        unchanged(f"flat_params after your step{how}", target, target_before, "flat_params", step=step)
        if gather:
            compare_params(model, ref, step)
        else:
            first_difference("your shard of the parameters after the step (gather=False)", target,
                             layout.shard_of(flat(list(ref.parameters()))), step=step, rtol=PARAM_RTOL,
                             atol=PARAM_ATOL)
            layout.shard_of(flat_params).copy_(target)
        kept = _kept_bytes(state, {flat_params.untyped_storage().data_ptr(), flat_grad.untyped_storage().data_ptr(),
                                   target.untyped_storage().data_ptr()})
        if kept == 0:
            raise Wrong("`state` holds no tensor after the step: keep this rank's master shard and its Adam "
                        "in it, so that they persist from step to step", step)
        if kept > limit:
            raise Wrong(f"you keep {kib(kept, unit=True)} of optimizer states; ZeRO-1 keeps at most "
                        f"{kib(limit, unit=True)}: an fp32 master copy and Adam's two moments for this rank's "
                        f"{layout.shard_numel:,} elements only, K Psi / Nd bytes with K = {K} (Sec 5.1)", step)
        agree(step)
    kept_bf16 = _bf16_trial(fn, ws, rank, first=STEPS + 2)
    return (f"gradient shards and parameters equal single-process Adam for {STEPS} fp32 steps, and as ZeRO-2 and "
            f"ZeRO-3 call it; 2.0 Psi per step; in bf16 an fp32 master and fp32 moments, "
            f"{kib(kept_bf16, unit=True)} on this rank: K Psi / Nd with K = {K} for Psi = {psi:,} "
            f"(+ {layout.padding} padding) on {ws} ranks")


def _bf16_trial(fn, ws: int, rank: int, first: int) -> int:
    """Mixed precision: bf16 parameters and gradients, steps ``first`` onwards. Each step's gradient
    shard against the exact mean of the ranks' bf16 gradients (within bf16's rounding of the sum),
    the fp32 master against fp32 Adam stepped with that gradient, the bf16 parameters against that
    master cast to bf16, 2 Psi moved, at most K Psi / Nd kept. Returns the bytes kept."""
    model, _, params, layout, flat_params = _setup(ws, rank, torch.bfloat16)
    n = layout.shard_numel
    a, b = layout.shard_range
    mirror = nn.Parameter(flat_params[a:b].float())  # the trial's own fp32 master, stepped as the reader's should be
    adam = torch.optim.Adam([mirror], lr=LR)
    state: dict = {}
    kept = 0
    for i in range(STEPS):
        step = first + i
        (x, y), _ = batches(step)
        loss_of(model, x, y).backward()
        flat_grad = layout.flatten([p.grad for p in params], torch.bfloat16, torch.device("cpu"))
        for p in params:
            p.grad = None
        every = torch.empty(ws * flat_grad.numel(), dtype=torch.bfloat16)
        comm.all_gather(every, flat_grad)  # every rank's bf16 gradient: the exact mean to compare with
        every = every.view(ws, -1)[:, a:b]
        every = every.double()
        want, scale = every.sum(0) / ws, every.abs().sum(0) / ws
        comm.LEDGER.reset()
        got = fn(flat_params, flat_grad, state, ws, rank, LR)
        if not isinstance(got, torch.Tensor) or got.shape != (n,):
            raise Wrong(f"in bf16: your function returned {type(got).__name__} "
                        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else ''}; expected the ({n},) gradient "
                        "shard Adam stepped with", step)
        if got.dtype != torch.float32:
            raise Wrong(f"in bf16: the gradient shard you stepped with is {got.dtype}; Adam steps the fp32 master "
                        "with an fp32 gradient: cast the reduced shard with .float()", step)
        bad = _bf16_close(got, want, scale)
        if bad.any():
            j = int(bad.nonzero()[0])
            for factor, why in ((ws, "the sum over the ranks, not their mean: divide by world_size once"),
                                (1 / ws, "the mean divided by world_size once more: you divided twice")):
                if not _bf16_close(got, want * factor, scale * factor).any():
                    raise Wrong(f"in bf16: the gradient shard you stepped with is {why}", step)
            trap = "" if ws & (ws - 1) == 0 else (
                f". Did you divide each rank's bf16 gradient by world_size before the reduce-scatter? Then "
                f"g / {ws} rounds to bf16's 8 bits on every rank before the sum (a division by 2, or any power of "
                "2, is exact: that is why 2 ranks passed). Reduce-scatter the gradient as it is and divide the "
                "shard after it, in fp32: grad.float() / world_size")
            raise Wrong(f"in bf16 on {ws} ranks: the gradient shard you stepped with, element {j}: you have "
                        f"{got[j].item():.6g}, the mean of the ranks' bf16 gradients is {want[j].item():.6g}{trap}",
                        step)
        _check_optimizers(state, step)
        moved = comm.LEDGER.volume_elements()
        if moved != 2 * layout.padded_numel:
            raise Wrong(f"in bf16 you moved {psi_per_step(moved, layout.numel)} per step; ZeRO-1 moves 2.0 Psi", step)
        mirror.grad = got.detach().clone()
        adam.step()
        _check_mixed_precision(state, mirror.detach(), step)
        every = torch.empty(ws * n, dtype=torch.bfloat16)
        comm.all_gather(every, mirror.detach().to(torch.bfloat16))
        first_difference("in bf16: the parameters after the step (the masters cast to bf16)", flat_params, every,
                         step=step, rtol=2.0 ** -7, atol=1e-6, reference="fp32 Adam on the masters")
        if flat_params.dtype != torch.bfloat16:
            raise Wrong(f"in bf16: flat_params became {flat_params.dtype}; write the update into it in place", step)
        kept = _kept_bytes(state, {flat_params.untyped_storage().data_ptr(), flat_grad.untyped_storage().data_ptr()})
        if kept > K * n:
            raise Wrong(f"in bf16 you keep {kib(kept, unit=True)} of optimizer states; ZeRO-1 keeps at most "
                        f"{kib(K * n, unit=True)}: K = {K} bytes (fp32 master and two moments) per element of this "
                        f"rank's {n:,}", step)
        agree(step)
    return kept


_allreduce_then_broadcast = edited(
    zero1_step, {"grad = torch.empty(n, dtype=flat_grad.dtype)\n"
                 "        dist.reduce_scatter_single(grad, flat_grad)  # the sum over ranks of this rank's shard only":
                 "dist.all_reduce(flat_grad)\n        grad = flat_grad[rank * n:(rank + 1) * n]",
                 "dist.all_gather_single(flat_params, working)  # every rank's updated shard, on every rank":
                 "flat_params[rank * n:(rank + 1) * n].copy_(working)\n        for owner in range(world_size):\n"
                 "            dist.broadcast(flat_params[owner * n:(owner + 1) * n], src=owner)"},
    name="_allreduce_then_broadcast",
    doc="""Seed 002 (the blog reproduction this book starts from): every gradient is
    all-reduced (2 Psi), the owner steps its shard, then each owner broadcasts its
    updated parameters (Psi more): 3 Psi per step for the numbers of 2 Psi.""")

_whole_model_state = edited(
    zero1_step, {"mine = flat_params[rank * n:(rank + 1) * n] if gather else flat_params": "mine = flat_params",
                 "    master.grad = grad\n": "    master.grad = torch.empty(flat_grad.numel())\n"
                                             "    dist.all_gather_single(master.grad, grad)\n",
                 "dist.all_gather_single(flat_params, working)  # every rank's updated shard, on every rank":
                 "flat_params.copy_(working)"},
    name="_whole_model_state",
    doc="""Every rank keeps an fp32 master and Adam's moments for the whole model and steps all
    of it: DP's optimizer, the redundancy ZeRO-1 exists to remove (Sec 4, Sec 5.1).""")

_average_twice = edited(
    zero1_step, {"dist.reduce_scatter_single(grad, flat_grad)  # the sum over ranks of this rank's shard only":
                 "dist.reduce_scatter_single(grad, flat_grad / world_size)"},
    name="_average_twice",
    doc="""Nd divided out before the sum (as engines do, to keep fp16 sums finite) and again
    after it. Adam's update barely changes with the gradient's scale, so only the
    gradient itself shows the mistake.""")

_divide_before_reduce = edited(
    zero1_step, {"dist.reduce_scatter_single(grad, flat_grad)  # the sum over ranks of this rank's shard only":
                 "dist.reduce_scatter_single(grad, flat_grad / world_size)",
                 "grad = grad.float() / world_size  # averaged in fp32, where Adam works": "grad = grad.float()"},
    name="_divide_before_reduce",
    doc="""Nd divided out of each rank's gradient before the reduce-scatter, in the working dtype (as
    the engines of chapter 1 divide before the sum, to keep fp16 sums finite). In fp32 and on 2
    ranks (a division by 2 is exact) it passes; in bf16 on 3 ranks each g / 3 loses bits first.""")

_default_lr = edited(
    zero1_step, {'torch.optim.Adam([state["master"]], lr=lr)': 'torch.optim.Adam([state["master"]])'},
    name="_default_lr", doc="torch.optim.Adam built without ``lr=``: it steps at its default, 1e-3, whatever lr says.")

_adamw = edited(
    zero1_step, {"torch.optim.Adam([": "torch.optim.AdamW(["}, name="_adamw",
    doc="""AdamW for Adam: its decoupled weight decay (0.01 by default) moves every parameter a little
    more than single-process Adam does, too little to see in one step's parameters.""")


_rebinds_params = edited(
    zero1_step, {"dist.all_gather_single(flat_params, working)  # every rank's updated shard, on every rank":
                 "full = torch.empty_like(flat_params)\n        dist.all_gather_single(full, working)\n"
                 "        flat_params = full  # meant to update the parameters"},
    name="_rebinds_params",
    doc="""The updated parameters gathered into a new tensor and bound to the name ``flat_params``: the
    caller's buffer, which the model's parameters view, is never written.""")


_gather_not_waited = edited(
    zero1_step, {"dist.all_gather_single(flat_params, working)  # every rank's updated shard, on every rank":
                 "state['gather'] = dist.all_gather_single(flat_params, working, async_op=True)  # waited later"},
    name="_gather_not_waited",
    doc="""The all-gather of the updated parameters launched with async_op=True and its handle kept for
    later: the step returns while the backend still writes flat_params, which the forward reads.""")


def _extra_gather_on_one_rank(flat_params, flat_grad, state, world_size, rank, lr, **_):
    """The reference step, then on the last rank only one more all-gather (a debugging gather left
    in under ``if rank == ...``): its peers never call it, so that rank waits in it for ever."""
    grad = zero1_step(flat_params, flat_grad, state, world_size, rank, lr)
    if rank == world_size - 1:
        dist.all_gather_single(flat_params, state["master"].detach())
    return grad


_bf16_master = edited(
    zero1_step, {"mine.detach().to(torch.float32, copy=True)": "mine.detach().clone()",
                 "    master.grad = grad\n": "    master.grad = grad.to(master.dtype)\n"},
    name="_bf16_master",
    doc="""No fp32 master: Adam steps a copy of the shard in the working dtype, so in bf16 its moments
    are bf16 too (6 bytes per element instead of K = 12) and small updates round away.""")


def _master_from_params(flat_params, flat_grad, state, world_size, rank, lr, **flags):
    """The fp32 master refreshed from the working parameters before every step: in bf16 it keeps
    only bf16's 8 bits, so the master is there (K = 12 bytes) but does nothing."""
    if flags:  # as ZeRO-2 and ZeRO-3 call it: the reference step
        return zero1_step(flat_params, flat_grad, state, world_size, rank, lr, **flags)
    shard = flat_grad.numel() // world_size
    if state:
        with torch.no_grad():
            state["master"].copy_(flat_params[rank * shard:(rank + 1) * shard])
    return zero1_step(flat_params, flat_grad, state, world_size, rank, lr)


register(Exercise(
    "02.zero1_step", "ZeRO-1: reduce-scatter, update this rank's shard, all-gather",
    zero1_step, _zero1_trial,
    {"allreduce_then_broadcast": Bug(_allreduce_then_broadcast, "seed 002, the blog's ShardedOptimizer",
                                     "ZeRO-1 moves 2.0 Psi"),
     "whole_model_state": Bug(_whole_model_state, "DP's optimizer kept on every rank", "KiB of optimizer states"),
     "average_twice": Bug(_average_twice, "dividing by Nd before and after the sum", "divided twice"),
     "divide_before_reduce": Bug(_divide_before_reduce, "Nd divided out of the bf16 gradient before the "
                                 "reduce-scatter: exact on 2 ranks, rounded on 3", "divide the shard after it"),
     "default_lr": Bug(_default_lr, "an optimizer built without lr= (a test at Adam's default lr cannot see it)",
                       "(Adam's default"),
     "adamw": Bug(_adamw, "torch.optim.AdamW for Adam: the names differ by one letter", "your optimizer is AdamW"),
     "extra_gather_on_one_rank": Bug(_extra_gather_on_one_rank, "a collective under `if rank == ...`: one rank "
                                     "waits in it, its peers never call it", "never call"),
     "rebinds_params": Bug(_rebinds_params, "a new tensor bound to the name flat_params instead of written into "
                           "it", "binds the name to a new tensor"),
     "bf16_master": Bug(_bf16_master, "Adam stepping the bf16 parameters' shard: no fp32 master (K = 6 instead "
                        "of 12)", "your optimizer steps torch.bfloat16 tensors"),
     "master_from_params": Bug(_master_from_params, "an fp32 master copied back from the bf16 parameters every "
                               "step: counted in K, but its precision is lost", "your fp32 master differs"),
     "gather_not_waited": Bug(_gather_not_waited, "the parameters' all-gather launched async and never waited "
                              "for in the step", "before its handle's .wait()")},
    async_reads=True))
