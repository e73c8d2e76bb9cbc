"""Exercise ``04.prefetch``'s check: ZeRO-3's prefetch, in forward and in backward (paper Sec 5.3).

While one unit computes, the next unit's all-gather is in flight: in forward the unit
after it, in backward the unit before it. The trial cuts the book's MLP into one unit
per Linear layer as ``04.gather_hooks`` does and, for three steps with the shards
changed between them, runs an evaluation forward (under torch.no_grad) and a training
forward and backward. It logs the order of launches, waits and computes (by wrapping
``dist.all_gather_single``, and with hooks of its own that run after the reader's), and checks
the output and every gradient against one process, that each unit's all-gather
finished before it computed while the next one's was in flight, that at most two units
were gathered at once, that nothing stays gathered after a pass and that a training
step gathers every unit twice (2 Psi).

A unit read while its buffer holds no bytes makes torch raise ("setStorage: sizes
...", "data is not allocated yet", "storage of size 0"); the trial turns that into
what happened: which pass read which freed units, the reader's line if it was theirs.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch04.prefetch`.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.chapters.ch04.prefetch import prefetch
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, first_difference, register
from zerolearn.exercises.helpers import LAYERS, WIDTH, gathered_units, mlp, sharded_units

BATCH, STEPS = 12, 3
FREED_READ = ("setStorage", "data is not allocated yet", "storage of size 0")
"""Words of torch's errors for a tensor whose storage holds fewer bytes than its view needs."""


_waits_at_once = edited(prefetch, {
    "        handles[j] = dist.all_gather_single(flats[j], shards[j], async_op=True)\n":
    "        handles[j] = dist.all_gather_single(flats[j], shards[j], async_op=True)\n"
    "        handles[j].wait()\n"}, name="_waits_at_once")

_prefetches_previous = edited(prefetch, {
    "ready(i, i + 1)": "ready(i, i - 1)",
    "if 0 <= following < len(units):": "if -len(units) <= following < len(units):  # -1: Python's last unit"},
    name="_prefetches_previous")

_forward_only = edited(prefetch, {
    "        if output.requires_grad:  # backward will need units[i] again; it runs the units in reverse\n"
    "            output.register_hook(lambda grad: ready(i, i - 1))\n": ""}, name="_forward_only",
    doc="The forward prefetch alone: units freed after forward, never gathered for backward.")

_backward_prefetches_next = edited(
    prefetch, {"ready(i, i - 1)": "ready(i, i + 1)"}, name="_backward_prefetches_next",
    doc="Backward prefetching units[i + 1], forward's direction, which backward has already done.")


class _Logged:
    """A handle that writes ("wait", unit) in the log when waited for."""

    def __init__(self, handle, unit, log):
        self._handle, self._unit, self._log = handle, unit, log

    def wait(self):
        self._log.append(("wait", self._unit, ()))
        self._handle.wait()


def _verify_order(log: list, n: int, step: int) -> None:
    """Raise :class:`Wrong` at the first compute (forward: ``"compute"``, backward: ``"backward"``)
    whose unit is not ready or whose successor in that direction is not in flight."""
    launched, waited = set(), set()
    for event, i, gathered in log:
        if event == "launch":
            launched.add(i)
            waited.discard(i)
        elif event == "sync":
            launched.add(i)
            waited.add(i)
        elif event == "wait":
            waited.add(i)
        elif event in ("compute", "backward"):
            forward = event == "compute"
            pass_ = "forward" if forward else "backward"
            nxt = i + 1 if forward else i - 1
            hook = "forward pre-hook" if forward else "hook on its output (it runs just before its backward)"
            if i not in launched or i not in waited:
                raise Wrong(f"unit {i} computed its {pass_} before its all-gather "
                            f"{'finished' if i in launched else 'started'}: wait for its handle in its {hook}", step)
            flying = sorted(launched - waited - {i})
            if 0 <= nxt < n and nxt not in flying:
                if nxt in launched and nxt in waited:
                    raise Wrong(f"unit {nxt}'s all-gather was waited for before unit {i} computed its {pass_}: "
                                f"nothing overlaps; wait for it only when unit {nxt} needs it", step)
                theirs = f"the all-gather in flight was unit {flying[0]}'s" if flying else "no all-gather was in flight"
                order = "" if forward else " (backward runs the units in reverse)"
                raise Wrong(f"while unit {i} computed its {pass_}, {theirs}; the {pass_} needs unit {nxt} next"
                            f"{order}: launch units[{nxt}]'s all-gather in units[{i}]'s {hook}", step)
            if len(gathered) > 2:
                raise Wrong(f"while unit {i} computed its {pass_}, units {list(gathered)} were gathered; prefetch "
                            f"holds at most this unit and the next: free each unit after its {pass_}", step)
            launched.discard(i)
            waited.discard(i)


def _readers_line(tb, fn) -> str:
    """' (your line N: code)' for the last frame of the reader's function (or a cell) in ``tb``, or ''."""
    try:
        lines, first = inspect.getsourcelines(fn)
        home = Path(inspect.getsourcefile(fn) or "").resolve()
    except (OSError, TypeError):
        lines, first, home = [], 0, None
    package = Path(comm.__file__).resolve().parent

    def theirs(frame) -> bool:
        if frame.filename.startswith("<cell") or frame.filename.startswith("<ipython"):
            return True
        path = Path(frame.filename).resolve()
        if path == home and first <= frame.lineno < first + len(lines):
            return True
        return not (path.is_relative_to(package) or "site-packages" in path.parts or frame.filename.startswith("<")
                    or path.is_relative_to(Path(torch.__file__).resolve().parent.parent)
                    or path.is_relative_to(Path(contextlib.__file__).resolve().parent))

    mine = [f for f in tb if theirs(f)]
    if not mine:
        return ""
    return f" (your line {mine[-1].lineno}: {mine[-1].line})" if mine[-1].line else f" (your line {mine[-1].lineno})"


@contextlib.contextmanager
def _freed_read(when: str, flats, log: list, fn, step: int):
    """Turn torch's error for a view of an emptied storage (:data:`FREED_READ`) into what the
    reader's hooks did: which units were freed, which all-gathers were in flight, and the
    reader's line when the read was in their code."""
    try:
        yield
    except RuntimeError as e:
        if not any(words in str(e) for words in FREED_READ):
            raise
        freed = sorted(set(range(len(flats))) - set(gathered_units(flats)))
        launched, waited = set(), set()
        for event, i, _ in log:
            if event in ("launch", "sync"):
                launched.add(i)
                (waited.add if event == "sync" else waited.discard)(i)
            elif event == "wait":
                waited.add(i)
        flying = sorted(launched - waited)
        line = _readers_line(traceback.extract_tb(e.__traceback__), fn)
        cause = (f"units {freed} held 0 bytes then (freed, or not gathered yet)" if freed else
                 "a buffer held 0 bytes")
        if flying:
            cause += f", and units {flying} had an all-gather in flight, not waited for"
        fix = ("make sure each unit is gathered, its all-gather waited for, in its forward pre-hook"
               if when == "forward" else "gather each unit again before its backward, from a hook on its forward "
               "output, and free it only once all its parameters have their gradient")
        raise Wrong(f"the {when} read the parameters of a unit whose buffer held no data{line}: {cause}; {fix}",
                    step) from None


def _patched_all_gathers() -> list[tuple]:
    """(module, name, function) of every all-gather into one tensor a reader may call: torch's
    names (``all_gather_single``, and ``all_gather_into_tensor`` as torch 2.11 calls it) and
    :func:`zerolearn.comm.all_gather`."""
    names = [(dist, n) for n in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
    return [(m, n, getattr(m, n)) for m, n in names + [(comm, "all_gather")]]


def _prefetch_trial(fn) -> str:
    """Evaluation and training passes of the MLP, one unit per layer, logging launches, waits and computes."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, layouts, flats, shards = sharded_units(ws, rank)
    ref = mlp()
    padded = sum(lay.padded_numel for lay in layouts)
    log: list[tuple[str, int, tuple]] = []  # (event, unit, units gathered at a compute)
    patched = _patched_all_gathers()

    def logging(original):
        def all_gather(output, input, group=None, async_op=False, **kwargs):
            ptr = output.untyped_storage().data_ptr()
            unit = next((i for i, f in enumerate(flats) if ptr and f.untyped_storage().data_ptr() == ptr), None)
            if unit is None:
                raise Wrong("your all_gather wrote into a tensor that is not one of flats, or into one whose "
                            "storage holds 0 bytes: grow flats[i]'s storage back, then gather into flats[i] itself, "
                            "the buffer its unit's parameters are views of")
            handle = original(output, input, group=group, async_op=async_op, **kwargs)
            log.append(("launch" if async_op else "sync", unit, ()))
            return _Logged(handle, unit, log) if async_op else handle
        return all_gather

    def log_backward(i, output):
        if output.requires_grad:  # registered after the reader's hook: runs just after it
            output.register_hook(lambda grad: log.append(("backward", i, tuple(gathered_units(flats)))))

    for module, name, original in patched:
        setattr(module, name, logging(original))
    try:
        fn(list(model.layers), flats, shards, ws)
        for i, unit in enumerate(model.layers):  # after the reader's: the unit is about to compute
            unit.register_forward_pre_hook(
                lambda module, args, i=i: log.append(("compute", i, tuple(gathered_units(flats)))))
            unit.register_forward_hook(lambda module, args, output, i=i: log_backward(i, output))
        for step in range(STEPS):
            log.clear()
            x, y = data.mlp_batch(step, BATCH, WIDTH)
            with torch.no_grad(), _freed_read("forward", flats, log, fn, step):
                out = model(x)
                want = ref(x)
            _verify_order(log, LAYERS, step)
            first_difference("the model's output (evaluation)", out, want, step=step)
            if gathered := gathered_units(flats):
                raise Wrong(f"after an evaluation forward, units {gathered} are still gathered: free each unit in "
                            "its forward hook", step)
            log.clear()
            comm.LEDGER.reset()
            with _freed_read("forward", flats, log, fn, step):
                loss = F.mse_loss(model(x), y)
            with _freed_read("backward", flats, log, fn, step):
                loss.backward()
            _verify_order(log, LAYERS, step)
            ref.zero_grad()
            F.mse_loss(ref(x), y).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                first_difference(f"the gradient of {name!r}", p.grad, q.grad, step=step)
                p.grad = None
            if gathered := gathered_units(flats):
                raise Wrong(f"after backward, units {gathered} are still gathered: free each unit once all its "
                            "parameters have their gradient", step)
            gathered = comm.LEDGER.as_dict()["all_gather"]["elements"]
            if gathered != 2 * padded:
                raise Wrong(f"a training step all-gathered {gathered / padded:.2f} times the units' elements; ZeRO-3 "
                            "gathers every unit once before its forward and once before its backward: 2 Psi "
                            "(Sec 7.2.2)", step)
            with torch.no_grad():  # an optimizer step between passes: the next gathers must bring new values
                for shard in shards:
                    shard.mul_(0.9)
                for p in ref.parameters():
                    p.mul_(0.9)
            agree(step)
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
    return (f"{STEPS} evaluation and training passes through {LAYERS} units: outputs and gradients equal one "
            "process; while each unit computed, in forward and in backward, the next one's all-gather was in "
            "flight, at most two units gathered; 2 Psi gathered per training step")


register(Exercise(
    "04.prefetch", "ZeRO-3's prefetch: the next unit's all-gather in flight while this one computes, both ways",
    prefetch, _prefetch_trial,
    {"waits_at_once": Bug(_waits_at_once, "an asynchronous collective waited for right after its launch (the "
                          "torch.cuda.synchronize() after an async call of STYLE.md): no overlap left",
                          "nothing overlaps"),
     "prefetches_previous": Bug(_prefetches_previous, "backward's prefetch direction (units[i - 1]) used in "
                                "forward; for the first unit Python reads units[-1], the last",
                                "the all-gather in flight was unit 3's"),
     "forward_only": Bug(_forward_only, "the forward prefetch alone (an evaluation-only ZeRO-3): units freed "
                         "after forward are read again by backward", "the backward read the parameters of a unit "
                         "whose buffer held no data"),
     "backward_prefetches_next": Bug(_backward_prefetches_next, "forward's direction (units[i + 1]) kept in "
                                     "backward, which runs the units in reverse", "backward runs the units in "
                                     "reverse")}))
