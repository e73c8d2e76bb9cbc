"""Exercise ``04.prefetch``'s check: ZeRO-3's prefetch (paper Sec 5.3).

While one unit computes, the next unit's all-gather is in flight. The trial cuts the
book's MLP into one unit per Linear layer as ``04.gather_hooks`` does, runs three
evaluation forwards with the shards changed between them, logs the order of
launches, waits and computes (by wrapping ``comm.all_gather``), and checks the
output against one process, that each unit's all-gather finished before it computed
while the next unit's was in flight, and that at most two units were gathered at once.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch04.prefetch`.
"""

from __future__ import annotations

import torch

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.chapters.ch04.prefetch import prefetch
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, first_difference, register
from zerolearn.exercises.helpers import LAYERS, WIDTH, gathered_units, mlp, sharded_units

BATCH, STEPS = 12, 3


def _prefetching(units, flats, shards, world_size, wait_at_once=False, step=1):
    handles = {}

    def start(i):
        flats[i].untyped_storage().resize_(flats[i].numel() * flats[i].element_size())
        handles[i] = comm.all_gather(flats[i], shards[i], async_op=True)
        if wait_at_once:
            handles[i].wait()

    def before_forward(i):
        if i not in handles:
            start(i)
        handles.pop(i).wait()
        if i + step < len(units):  # step -1: i - 1 is -1 for the first unit, Python's last
            start(i + step)

    def after_forward(i):
        flats[i].untyped_storage().resize_(0)

    for i, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda module, args, i=i: before_forward(i))
        unit.register_forward_hook(lambda module, args, output, i=i: after_forward(i))


def _waits_at_once(units, flats, shards, world_size):
    _prefetching(units, flats, shards, world_size, wait_at_once=True)


def _prefetches_previous(units, flats, shards, world_size):
    _prefetching(units, flats, shards, world_size, step=-1)


class _Logged:
    """A handle that writes ("wait", unit) in the log when waited for."""

    def __init__(self, handle, unit, log):
        self._handle, self._unit, self._log = handle, unit, log

    def wait(self):
        self._log.append(("wait", self._unit))
        self._handle.wait()


def _verify_order(log: list, flats, n: int, step: int) -> None:
    """Raise :class:`Wrong` at the first compute whose unit is not ready or whose successor is not in flight."""
    launched, waited = set(), set()
    for event, i in log:
        if event == "launch":
            launched.add(i)
            waited.discard(i)
        elif event == "sync":
            launched.add(i)
            waited.add(i)
        elif event == "wait":
            waited.add(i)
        elif event == "compute":
            if i not in launched or i not in waited:
                raise Wrong(f"unit {i} computed before its all-gather {'finished' if i in launched else 'started'}: "
                            "wait for its handle in its forward pre-hook", step)
            flying = sorted(launched - waited - {i})
            if i + 1 < n and i + 1 not in flying:
                if i + 1 in launched:
                    raise Wrong(f"unit {i + 1}'s all-gather was waited for before unit {i} computed: nothing "
                                f"overlaps; wait for it in unit {i + 1}'s forward pre-hook", step)
                theirs = f"the all-gather in flight was unit {flying[0]}'s" if flying else "no all-gather was in flight"
                raise Wrong(f"while unit {i} computed, {theirs}; the next forward needs unit {i + 1}: launch "
                            f"units[{i + 1}]'s all-gather in units[{i}]'s forward pre-hook", step)
            if len(gathered := gathered_units(flats)) > 2:
                raise Wrong(f"while unit {i} computed, units {gathered} were gathered; prefetch holds at most "
                            "this unit and the next: free each unit in its forward hook", step)


def _prefetch_trial(fn) -> str:
    """Evaluation forwards of the MLP, one unit per layer, logging launches, waits and computes."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, layouts, flats, shards = sharded_units(ws, rank)
    ref = mlp()
    log: list[tuple[str, int]] = []
    original = comm.all_gather

    def all_gather(output, input, group=None, async_op=False, tag="dp"):
        ptr = output.untyped_storage().data_ptr()
        unit = next((i for i, f in enumerate(flats) if ptr and f.untyped_storage().data_ptr() == ptr), None)
        if unit is None:
            raise Wrong("your all_gather wrote into a tensor that is not one of flats: gather into flats[i] "
                        "itself, the buffer its unit's parameters are views of")
        handle = original(output, input, group=group, async_op=async_op, tag=tag)
        log.append(("launch" if async_op else "sync", unit))
        return _Logged(handle, unit, log) if async_op else handle

    comm.all_gather = all_gather
    try:
        fn(list(model.layers), flats, shards, ws)
        for i, unit in enumerate(model.layers):  # after the reader's: the unit is about to compute
            unit.register_forward_pre_hook(lambda module, args, i=i: log.append(("compute", i)))
        for step in range(STEPS):
            log.clear()
            x = data.mlp_batch(step, BATCH, WIDTH)[0]
            with torch.no_grad():
                out = model(x)
                want = ref(x)
            _verify_order(log, flats, LAYERS, step)
            first_difference("the model's output", out, want, step=step)
            if gathered := gathered_units(flats):
                raise Wrong(f"after forward, units {gathered} are still gathered: free each unit in its forward "
                            "hook", step)
            with torch.no_grad():  # an optimizer step between passes: the next gathers must bring new values
                for shard in shards:
                    shard.mul_(0.9)
                for p in ref.parameters():
                    p.mul_(0.9)
            agree(step)
    finally:
        comm.all_gather = original
    return (f"{STEPS} evaluation forwards through {LAYERS} units: outputs equal one process, and while each unit "
            "computed the next one's all-gather was in flight, at most two units gathered")


register(Exercise(
    "04.prefetch", "ZeRO-3's prefetch: the next unit's all-gather in flight while this one computes",
    prefetch, _prefetch_trial,
    {"waits_at_once": Bug(_waits_at_once, "an asynchronous collective waited for right after its launch (the "
                          "torch.cuda.synchronize() after an async call of STYLE.md): no overlap left",
                          "nothing overlaps"),
     "prefetches_previous": Bug(_prefetches_previous, "backward's prefetch direction (units[i - 1]) used in "
                                "forward; for the first unit Python reads units[-1], the last",
                                "the all-gather in flight was unit 3's")}))
