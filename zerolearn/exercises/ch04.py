"""Chapter 04's exercises: ZeRO-3's gather and free around each unit (paper Sec 5.3, 7.2.2).

* ``04.gather_hooks``: module and gradient hooks that all-gather a unit's parameters
  before its forward and again before its backward, and free them after each.
* ``04.prefetch``: while one unit computes, the next unit's all-gather is in flight.

The trials cut the book's MLP (4 Linear layers of width 64, 4,160 parameters each,
fp32) into one unit per layer, laid out as the engine lays them: each unit's
parameters are views of a flat buffer whose storage is resized to 0 bytes between
uses, and each rank keeps its shard. ``04.gather_hooks`` trains three SGD steps
against one process under the memory ledger; ``04.prefetch`` runs evaluation forwards
and logs the order of launches, waits and computes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.exercises.ch03 import LR, WIDTH, compare_shard, kib
from zerolearn.exercises.core import Bug, Exercise, Wrong, first_difference, register
from zerolearn.flat import FlatLayout
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.models import build_model

LAYERS, BATCH, STEPS = 4, 12, 3
CPU = torch.device("cpu")


def _sharded_units(world_size: int, rank: int):
    """The MLP with each Linear a unit: (model, layouts, flats freed to 0 bytes, shards)."""
    model = build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)
    layouts, flats, shards = [], [], []
    for i, unit in enumerate(model.layers):
        named = list(unit.named_parameters(prefix=f"layers.{i}"))
        layout = FlatLayout.of([n for n, _ in named], [p.shape for _, p in named], world_size, rank)
        flat = layout.flatten([p for _, p in named], torch.float32, CPU)
        shards.append(layout.shard_of(flat).clone())
        layout.bind([p for _, p in named], flat)
        flat.untyped_storage().resize_(0)
        layouts.append(layout)
        flats.append(flat)
    return model, layouts, flats, shards


def _gathered(flats) -> list[int]:
    return [i for i, f in enumerate(flats) if f.untyped_storage().nbytes() > 0]


# ----- 04.gather_hooks -------------------------------------------------------------------

def gather_hooks(unit, flat, shard, world_size):
    """Gather ``unit``'s parameters just before its forward and its backward; free them after each (Sec 5.3).

    Args:
        unit: an nn.Module (here a Linear layer) whose parameters are views of ``flat``.
        flat: fp32, 1-D, world_size * shard.numel() elements: the unit's parameters laid
            end to end, zero-padded. Between uses its storage holds 0 bytes.
        shard: fp32, 1-D: this rank's slice of ``flat`` (elements rank * shard.numel()
            onwards), the only copy of the parameters a rank keeps; the optimizer updates
            it between steps.
        world_size: the number of data-parallel ranks, Nd.

    To gather, grow flat's storage back, ``flat.untyped_storage().resize_(flat.numel() * 4)``
    (bytes), and ``comm.all_gather(flat, shard)`` into it; to free, resize it to 0 bytes.
    Register on ``unit``: a forward pre-hook that gathers; a forward hook that frees and
    registers a hook on the output (``output.register_hook(fn)``: autograd calls
    ``fn(grad)`` just before the unit's backward) that gathers again; and a
    ``p.register_post_accumulate_grad_hook`` on each parameter that frees the unit once
    all of them have their gradient. Returns None.
    """
    # BEGIN SOLUTION
    params = list(unit.parameters())
    arrived = []

    def gather(*_):
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        comm.all_gather(flat, shard)

    def free():
        flat.untyped_storage().resize_(0)

    def after_forward(module, inputs, output):
        free()
        if output.requires_grad:
            output.register_hook(gather)  # runs just before this unit's backward

    def after_grad(p):
        arrived.append(p)
        if len(arrived) == len(params):  # backward is done with the unit
            arrived.clear()
            free()

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(after_grad)
    # END SOLUTION


def _hooks(unit, flat, shard, world_size, free_after_forward=True, gather_for_backward=True,
           free_after_backward=True):
    params, arrived = list(unit.parameters()), []

    def gather(*_):
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        comm.all_gather(flat, shard)

    def after_forward(module, inputs, output):
        if free_after_forward:
            flat.untyped_storage().resize_(0)
        if gather_for_backward and output.requires_grad:
            output.register_hook(gather)

    def after_grad(p):
        arrived.append(p)
        if len(arrived) == len(params):
            arrived.clear()
            if free_after_backward:
                flat.untyped_storage().resize_(0)

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(after_grad)


def _frees_before_backward(unit, flat, shard, world_size):
    _hooks(unit, flat, shard, world_size, gather_for_backward=False)


def _never_frees(unit, flat, shard, world_size):
    _hooks(unit, flat, shard, world_size, free_after_forward=False, free_after_backward=False)


def _keeps_after_backward(unit, flat, shard, world_size):
    _hooks(unit, flat, shard, world_size, free_after_backward=False)


@contextlib.contextmanager
def _read_while_freed(when: str, flats, step: int):
    """Turn torch's error for a view of a 0-byte storage into what the reader's hooks missed."""
    try:
        yield
    except RuntimeError as e:
        if "storage of size 0" not in str(e):
            raise
        freed = sorted(set(range(len(flats))) - set(_gathered(flats)))
        fix = ("in a forward pre-hook" if when == "forward" else "again before its backward, from a hook on its "
               "output")
        raise Wrong(f"{when} read the parameters of a unit your hooks had freed (units freed then: {freed}): gather "
                    f"each unit {fix}", step) from None


def _held_at_most(held: int, when: str, shard_bytes: int, unit_bytes: int, model_bytes: int, step: int) -> None:
    """Parameters held at once may be the shards plus two units (one computing, one prefetched), no more."""
    if held > shard_bytes + 2 * unit_bytes:
        whole = f"all {kib(model_bytes)}" if held - shard_bytes >= model_bytes else kib(held)
        raise Wrong(f"this rank held {whole} of parameters at once {when}; ZeRO-3 holds the shards plus one unit: "
                    f"{kib(shard_bytes + unit_bytes)} (free each unit after its forward and after its backward)", step)


def _gather_trial(fn) -> str:
    """Three SGD steps of the MLP, one unit per layer, the reader's hooks on every unit."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, layouts, flats, shards = _sharded_units(ws, rank)
    ref = build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)
    for unit, flat, shard in zip(model.layers, flats, shards):
        fn(unit, flat, shard, ws)
    psi, padded = sum(lay.numel for lay in layouts), sum(lay.padded_numel for lay in layouts)
    shard_bytes, unit_bytes = 4 * sum(s.numel() for s in shards), 4 * max(lay.padded_numel for lay in layouts)
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
        kept = _gathered(flats)
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_grads = dict(ref.named_parameters())
        for k, (unit, layout, shard) in enumerate(zip(model.layers, layouts, shards)):
            grad = torch.zeros(layout.shard_numel)
            comm.reduce_scatter(grad, layout.flatten([p.grad for p in unit.parameters()], torch.float32, CPU))
            want = layout.flatten([ref_grads[n].grad for n in layout.names], torch.float32, CPU)
            compare_shard(f"the gradient shard of unit {k}", grad / ws, layout.shard_of(want), layout, step)
            shard -= LR * grad / ws
            for p in unit.parameters():
                p.grad = None
        _held_at_most(peak_forward, "in forward", shard_bytes, unit_bytes, 4 * padded, step)
        if kept:
            raise Wrong(f"after backward, units {kept} are still gathered ({kib(4 * padded * len(kept) / LAYERS)}): "
                        "free a unit once all its parameters have their gradient", step)
        _held_at_most(peak, "in backward", shard_bytes, unit_bytes, 4 * padded, step)
        gathered = comm.LEDGER.as_dict()["all_gather"]["elements"]
        if gathered != 2 * padded:
            raise Wrong(f"your hooks all-gathered {gathered / psi:.2f} Psi in this step; ZeRO-3 gathers every unit "
                        f"before its forward and again before its backward: {2 * padded / psi:.2f} Psi, 3 Psi per "
                        "step with the gradients' reduce-scatter (Sec 7.2.2)", step)
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
    return (f"{STEPS} SGD steps, {LAYERS} units: gradients equal single-process training, parameters held at most "
            f"the shards plus one unit ({kib(peak)}), {3 * padded / psi:.2f} Psi per step with the gradients")


register(Exercise(
    "04.gather_hooks", "ZeRO-3's hooks: gather a unit before forward and backward, free it after each",
    gather_hooks, _gather_trial,
    {"frees_before_backward": Bug(_frees_before_backward, "freeing after forward with no gather before backward: "
                                  "autograd's saved views of the weight then read a 0-byte storage",
                                  "backward read the parameters of a unit your hooks had freed"),
     "never_frees": Bug(_never_frees, "a ZeRO-3 that gathers but never frees: its peak holds the whole model, "
                        "as ZeRO-2 does", "held all"),
     "keeps_after_backward": Bug(_keeps_after_backward, "freeing after forward only: backward's gathers pile up "
                                 "until the step", "still gathered")}))


# ----- 04.prefetch -----------------------------------------------------------------------

def prefetch(units, flats, shards, world_size):
    """Gather each unit before its forward, with the next unit's all-gather already in flight (Sec 5.3).

    Args:
        units: list of nn.Modules in the order forward runs them (here Linear layers).
        flats: list; flats[i] holds units[i]'s parameters laid end to end, fp32, 1-D,
            world_size * shards[i].numel() elements (zero-padded); units[i]'s parameters
            are views of it. Between uses its storage holds 0 bytes.
        shards: list; shards[i] is this rank's slice of flats[i], fp32, 1-D.
        world_size: the number of data-parallel ranks, Nd.

    The forward runs under torch.no_grad() (an evaluation pass): a unit can be freed
    as soon as its forward returns. Register on each units[i] a forward pre-hook that
    makes sure units[i] is gathered (waiting for its all-gather if one is in flight,
    gathering it now if none is) and then launches units[i + 1]'s all-gather without
    waiting: grow flats[i + 1]'s storage back to flats[i + 1].numel() * 4 bytes
    (``untyped_storage().resize_(nbytes)``) and call ``comm.all_gather(flats[i + 1],
    shards[i + 1], async_op=True)``, which returns a handle whose ``.wait()`` blocks
    until the data is there. And a forward hook that frees units[i]:
    ``flats[i].untyped_storage().resize_(0)`` (a forward hook must return None).
    Returns None.
    """
    # BEGIN SOLUTION
    handles = {}

    def start(i):
        flats[i].untyped_storage().resize_(flats[i].numel() * flats[i].element_size())
        handles[i] = comm.all_gather(flats[i], shards[i], async_op=True)

    def before_forward(i):
        if i not in handles:
            start(i)  # nothing prefetched it: the first unit
        handles.pop(i).wait()
        if i + 1 < len(units):
            start(i + 1)  # in flight while units[i] computes

    def after_forward(i):
        flats[i].untyped_storage().resize_(0)

    for i, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda module, args, i=i: before_forward(i))
        unit.register_forward_hook(lambda module, args, output, i=i: after_forward(i))
    # END SOLUTION


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
            if len(gathered := _gathered(flats)) > 2:
                raise Wrong(f"while unit {i} computed, units {gathered} were gathered; prefetch holds at most "
                            "this unit and the next: free each unit in its forward hook", step)


def _prefetch_trial(fn) -> str:
    """Evaluation forwards of the MLP, one unit per layer, logging launches, waits and computes."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, layouts, flats, shards = _sharded_units(ws, rank)
    ref = build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)
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
            if gathered := _gathered(flats):
                raise Wrong(f"after forward, units {gathered} are still gathered: free each unit in its forward "
                            "hook", step)
            with torch.no_grad():  # an optimizer step between passes: the next gathers must bring new values
                for shard in shards:
                    shard.mul_(0.9)
                for p in ref.parameters():
                    p.mul_(0.9)
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
