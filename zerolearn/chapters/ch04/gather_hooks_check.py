"""Exercise ``04.gather_hooks``'s check: ZeRO-3's gather and free around each unit (paper Sec 5.3, 7.2.2).

Module and gradient hooks all-gather a unit's parameters before its forward and again
before its backward, and free them after each. The trial cuts the book's MLP into one
unit per Linear layer, laid out as the engine lays them (each unit's parameters are
views of a flat buffer whose storage is resized to 0 bytes between uses; each rank
keeps its shard), trains three SGD steps against one process under the memory ledger,
and checks every gradient shard, that no more than the shards and one unit (plus one
prefetched) are held at once, that nothing stays gathered after backward, and that
every unit is all-gathered twice per step. It also counts the hooks registered on each
unit and parameter after every step (torch keeps them in the module's ``_forward_pre_hooks``
and ``_forward_hooks`` and the tensor's ``_post_accumulate_grad_hooks``): hooks registered
again in every forward pile up, each one running, while values and traffic stay right.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch04.gather_hooks`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.chapters.ch04.gather_hooks import gather_hooks
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, defined_at, edited, register
from zerolearn.exercises.helpers import (
    CPU,
    LAYERS,
    SGD_LR,
    WIDTH,
    compare_shard,
    gathered_units,
    mlp,
    sharded_units,
)
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.tables import kib

BATCH, STEPS = 12, 3


_frees_before_backward = edited(gather_hooks, {
    "        if output.requires_grad:\n"
    "            output.register_hook(gather)  # runs just before this unit's backward\n": ""},
    name="_frees_before_backward")

_never_frees = edited(gather_hooks, {"flat.untyped_storage().resize_(0)": "pass"}, name="_never_frees")

_keeps_after_backward = edited(gather_hooks, {"            arrived.clear()\n            free()\n":
                                              "            arrived.clear()\n"}, name="_keeps_after_backward")

_grad_hooks_every_forward = edited(gather_hooks, {
    "    for p in params:\n        p.register_post_accumulate_grad_hook(after_grad)\n": "",
    "            output.register_hook(gather)  # runs just before this unit's backward\n":
    "            output.register_hook(gather)  # runs just before this unit's backward\n"
    "        for p in params:  # one more hook per parameter in every forward\n"
    "            p.register_post_accumulate_grad_hook(after_grad)\n"}, name="_grad_hooks_every_forward")


@contextlib.contextmanager
def _read_while_freed(when: str, flats, step: int):
    """Turn torch's error for a view of a 0-byte storage into what the reader's hooks missed."""
    try:
        yield
    except RuntimeError as e:
        if "storage of size 0" not in str(e):
            raise
        freed = sorted(set(range(len(flats))) - set(gathered_units(flats)))
        fix = ("in a forward pre-hook" if when == "forward" else "again before its backward, from a hook on its "
               "output")
        raise Wrong(f"{when} read the parameters of a unit your hooks had freed (units freed then: {freed}): gather "
                    f"each unit {fix}", step) from None


def _held_at_most(held: int, when: str, shard_bytes: int, unit_bytes: int, model_bytes: int, step: int) -> None:
    """Parameters held at once may be the shards plus two units (one computing, one prefetched), no more."""
    if held > shard_bytes + 2 * unit_bytes:
        whole = f"all {kib(model_bytes, unit=True)}" if held - shard_bytes >= model_bytes else kib(held, unit=True)
        raise Wrong(f"this rank held {whole} of parameters at once {when}; ZeRO-3 holds the shards plus one unit: "
                    f"{kib(shard_bytes + unit_bytes, unit=True)} (free each unit after its forward and after its "
                    "backward)", step)


def _hooks_now(model) -> dict[str, list]:
    """The hooks registered now, by where: per unit, its forward pre-hooks and forward hooks;
    per parameter, its post-accumulate-grad hooks."""
    hooks = {}
    for i, unit in enumerate(model.layers):
        hooks[f"forward pre-hooks on unit {i}"] = list(unit._forward_pre_hooks.values())
        hooks[f"forward hooks on unit {i}"] = list(unit._forward_hooks.values())
        for name, p in unit.named_parameters(prefix=f"layers.{i}"):
            hooks[f"post-accumulate-grad hooks on parameter {name!r}"] = list(
                (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())
    return hooks


def _no_pile_up(hooks: dict[str, list], first: dict[str, int], step: int) -> None:
    """Hooks registered must not grow from step to step: autograd and the module call every one, every time."""
    for what, now in hooks.items():
        if len(now) > first[what]:
            which = f", the last {getattr(now[-1], '__name__', 'one')}{defined_at(now[-1])}"
            raise Wrong(f"after step {step}, {len(now)} {what}{which}; after step 0, {first[what]}: your hooks pile "
                        "up (registered again in every forward?), and every one of them runs each time. Register "
                        "each hook once, when gather_hooks is called (only the hook on a forward's output is new "
                        "with each output)", step)


def _check_units(model, layouts, shards, ref_grads: dict, step: int, ws: int) -> None:
    """Each unit's gradient, reduce-scattered, against the reference; SGD on the shards."""
    for k, (unit, layout, shard) in enumerate(zip(model.layers, layouts, shards, strict=True)):
        agree(step, point=f"unit {k}")  # every rank passed the units before: all join this reduce-scatter
        grad = torch.zeros(layout.shard_numel)
        comm.reduce_scatter(grad, layout.flatten([p.grad for p in unit.parameters()], torch.float32, CPU))
        want = layout.flatten([ref_grads[n].grad for n in layout.names], torch.float32, CPU)
        compare_shard(f"the gradient shard of unit {k}", grad / ws, layout.shard_of(want), layout, step)
        shard -= SGD_LR * grad / ws
        for p in unit.parameters():
            p.grad = None


def _gather_trial(fn) -> str:
    """Three SGD steps of the MLP, one unit per layer, the reader's hooks on every unit."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, layouts, flats, shards = sharded_units(ws, rank)
    ref = mlp()
    for unit, flat, shard in zip(model.layers, flats, shards, strict=True):
        fn(unit, flat, shard, ws)
    psi, padded = sum(lay.numel for lay in layouts), sum(lay.padded_numel for lay in layouts)
    shard_bytes, unit_bytes = 4 * sum(s.numel() for s in shards), 4 * max(lay.padded_numel for lay in layouts)
    hooks = None
    for step in range(STEPS):
        x, y = data.mlp_batch(step, BATCH, WIDTH)
        comm.LEDGER.reset()
        with MemoryLedger() as ledger:
            ledger.track(flats + shards, "params")
            with ledger.phase("forward"), _read_while_freed("forward", flats, step):
                loss = F.mse_loss(model(data.rank_slice(x, rank, ws)), data.rank_slice(y, rank, ws))
            with ledger.phase("backward"), _read_while_freed("backward", flats, step):
                loss.backward()
        peak_forward = max(e.by_category["params"] for e in ledger.timeline if e.phase != "backward")
        peak = max(e.by_category["params"] for e in ledger.timeline)
        kept = gathered_units(flats)
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        _check_units(model, layouts, shards, dict(ref.named_parameters()), step, ws)
        _held_at_most(peak_forward, "in forward", shard_bytes, unit_bytes, 4 * padded, step)
        if kept:
            raise Wrong(f"after backward, units {kept} are still gathered "
                        f"({kib(4 * padded * len(kept) / LAYERS, unit=True)}): free a unit once all its parameters "
                        "have their gradient", step)
        _held_at_most(peak, "in backward", shard_bytes, unit_bytes, 4 * padded, step)
        gathered = comm.LEDGER.as_dict()["all_gather"]["elements"]
        if gathered != 2 * padded:
            raise Wrong(f"your hooks all-gathered {gathered / psi:.2f} Psi in this step; ZeRO-3 gathers every unit "
                        f"before its forward and again before its backward: {2 * padded / psi:.2f} Psi, 3 Psi per "
                        "step with the gradients' reduce-scatter (Sec 7.2.2)", step)
        hooks = hooks or {what: len(now) for what, now in _hooks_now(model).items()}
        _no_pile_up(_hooks_now(model), hooks, step)
        with torch.no_grad():
            for p in ref.parameters():
                p -= SGD_LR * p.grad
        agree(step)
    return (f"{STEPS} SGD steps, {LAYERS} units: gradients equal single-process training, parameters held at most "
            f"the shards plus one unit ({kib(peak, unit=True)}), {3 * padded / psi:.2f} Psi per step with the "
            "gradients")


register(Exercise(
    "04.gather_hooks", "ZeRO-3's hooks: gather a unit before forward and backward, free it after each",
    gather_hooks, _gather_trial,
    {"frees_before_backward": Bug(_frees_before_backward, "freeing after forward with no gather before backward: "
                                  "autograd's saved views of the weight then read a 0-byte storage",
                                  "backward read the parameters of a unit your hooks had freed"),
     "never_frees": Bug(_never_frees, "a ZeRO-3 that gathers but never frees: its peak holds the whole model, "
                        "as ZeRO-2 does", "held all"),
     "keeps_after_backward": Bug(_keeps_after_backward, "freeing after forward only: backward's gathers pile up "
                                 "until the step", "still gathered"),
     "grad_hooks_every_forward": Bug(_grad_hooks_every_forward, "the post-accumulate-grad hooks registered in every "
                                     "forward: values, memory and traffic stay right, but the hooks pile up and "
                                     "every free runs once more each step", "your hooks pile up")}))
