"""ZeRO-3's unit schedule (P_os+g+p, Sec 5.3), recorded from a real engine: gather, prefetch,
compute and free of each unit in forward and backward, with the parameter memory alive.

:func:`zero3_schedule` builds a :class:`zerolearn.engines.Zero3Engine` around a small model in
this process (a process group of one rank, made for the run and left afterwards if none
existed), trains ``steps`` steps and records the last one: every all_gather the engine
issues through :mod:`zerolearn.comm` (and for which unit's buffer), every unit's forward and
backward, every free, and ``engine.gathered_bytes`` (full parameters alive) after each. So
the order drawn is the order the engine ran, not a description of it. At one rank a
prefetch gathers one unit per all_gather (units and prefetch are the package's way of
pipelining Sec 7.2.2's gathers; the paper names neither); several ranks fuse small
units into one all_gather (``prefetch_mb``), which changes the number of calls, not the order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from zerolearn import comm, guard
from zerolearn.errors import ConfigError, require_count
from zerolearn.figures.schematics.palette import rank_color

__all__ = ["KINDS", "UnitEvent", "Zero3Schedule", "alive_steps", "draw_zero3_frame", "one_rank_world",
           "zero3_animation", "zero3_figure", "zero3_schedule"]

KINDS = ("gather", "prefetch", "compute", "free")
KIND_COLORS = {"gather": "#4e79a7", "prefetch": "#76b7b2", "compute": "#f28e2b", "free": "#bab0ac"}


@dataclass(frozen=True)
class UnitEvent:
    """One event of the recorded step, in the order it happened.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        kind: ``"gather"`` (an all_gather the unit's own hook issued), ``"prefetch"`` (issued by
            another unit's hook, ahead of use), ``"compute"`` (the unit's forward or backward
            starts), ``"free"`` (its full parameters released).
        unit: the unit's name in the model (``layers.2``).
        alive_bytes: bytes of full (gathered) parameters alive just after the event.
    """

    phase: str
    kind: str
    unit: str
    alive_bytes: int


@dataclass(frozen=True)
class Zero3Schedule:
    """A recorded ZeRO-3 step. ``units``: names in forward order; ``unit_bytes``: each unit's
    gathered bytes (padding included); ``shard_bytes``: the working-parameter shards every
    rank keeps between uses; ``events``: :class:`UnitEvent` in order; ``gathers``:
    ``(phase, unit)`` of every all_gather call, in order; ``ledger_gathers``: all_gather calls
    the comm ledger counted in the step (equals ``len(gathers)``)."""

    units: list[str]
    unit_bytes: dict[str, int]
    shard_bytes: int
    events: list[UnitEvent]
    gathers: list[tuple[str, str]]
    ledger_gathers: int


@contextlib.contextmanager
def one_rank_world():
    """A process group of one rank (gloo) for the block, left afterwards; an existing group of
    one rank is used as it is.

    Raises:
        ConfigError: this process already belongs to a group of several ranks.
    """
    from zerolearn import dist as zdist

    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != 1:
            raise ConfigError(f"zero3_schedule runs in a world of one rank; this process is a rank of "
                              f"{torch.distributed.get_world_size()}; allowed: call it outside a multi-rank job")
        yield
        return
    zdist.init("gloo", "cpu")
    try:
        yield
    finally:
        zdist.teardown(clean=False)


def zero3_schedule(model: torch.nn.Module | None = None, inputs: torch.Tensor | None = None, *,
                   steps: int = 2, prefetch: bool = True) -> Zero3Schedule:
    """Record the last of ``steps`` ZeRO-3 steps on one rank (module docstring).

    Args:
        model: the model (fp32); default ``zerolearn.models.MLP(width=8, num_layers=4)``, whose
            units are its 4 Linear layers. Its parameters change (it is trained).
        inputs: a batch for ``model`` (default: (4, width) numbers from seed 0); the loss is the
            mean of the output squared.
        steps: steps to run (an integer >= 1; the first forward agrees on the schedule, later
            ones follow it, so the default records the second).
        prefetch: the engine prefetches the next unit (``schedule.prefetch``).

    Returns:
        a :class:`Zero3Schedule` (bytes, names of units).

    Raises:
        ConfigError: ``steps`` < 1, or this process is a rank of a multi-rank job.
    """
    from zerolearn.engines import Zero3Engine
    from zerolearn.models import MLP

    require_count("steps", steps)
    if model is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = MLP(width=8, num_layers=4)
            inputs = torch.randn(4, 8) if inputs is None else inputs
    if inputs is None:
        raise ConfigError("inputs None: allowed with model None only; pass a batch for your model")
    with one_rank_world(), _recording() as calls:
        engine = Zero3Engine(model, optimizer="sgd", lr=0.01, prefetch_mb=0)
        engine.schedule.prefetch = prefetch
        rec = _Recorder(engine, calls)
        for _ in range(steps):
            rec.events.clear()
            calls.clear()
            before = comm.LEDGER.ops["all_gather"].calls
            loss = engine(inputs).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            ledger = comm.LEDGER.ops["all_gather"].calls - before
        gathers = [(doing.split(":")[0], rec.unit_of(out)) for out, _, doing in calls]
        return Zero3Schedule([u.name for u in engine.units], {u.name: u.nbytes for u in engine.units},
                             sum(b.shard.nbytes for b in engine.buckets), list(rec.events), gathers, ledger)


@contextlib.contextmanager
def _recording():
    """Every ``comm.all_gather`` call in the block: ``(output tensor, calling unit, doing)``."""
    calls: list = []
    real = comm.all_gather

    def recorded(output, input, *args, **kwargs):
        calls.append((output, *guard.calling_unit()))
        if _recording.listener is not None:
            _recording.listener(output)
        return real(output, input, *args, **kwargs)

    comm.all_gather = recorded
    try:
        yield calls
    finally:
        comm.all_gather = real
        _recording.listener = None


_recording.listener = None


class _Recorder:
    """Hooks on a ZeRO-3 engine's units that append :class:`UnitEvent` as they run; each is
    registered after the engine's own, so it sees the engine's gather or free done."""

    def __init__(self, engine, calls: list):
        self.engine, self.events = engine, []
        self.by_storage = {b.full.untyped_storage()._cdata: u for u in engine.units for b in u.buckets}
        self.freed: set[str] = set()
        _recording.listener = self._gathering
        for unit in engine.units:
            unit.module.register_forward_pre_hook(lambda m, a, unit=unit: self._forward(unit))
            unit.module.register_forward_hook(lambda m, a, out, unit=unit: self._forward_done(unit, out))
            for b in unit.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_in(unit))

    def unit_of(self, tensor: torch.Tensor) -> str:
        return self.by_storage[tensor.untyped_storage()._cdata].name

    def _add(self, phase: str, kind: str, unit: str) -> None:
        self.events.append(UnitEvent(phase, kind, unit, self.engine.gathered_bytes))

    def _gathering(self, output: torch.Tensor) -> None:
        caller, doing = guard.calling_unit()
        name = self.unit_of(output)
        self._add(doing.split(":")[0], "gather" if caller == name else "prefetch", name)

    def _forward(self, unit) -> None:
        if not self.engine.in_backward:
            self.freed.discard(unit.name)
            self._add("forward", "compute", unit.name)

    def _forward_done(self, unit, out) -> None:
        if self.engine.in_backward:
            return
        self._add("forward", "free", unit.name)
        if torch.is_grad_enabled():
            for t in [out] if torch.is_tensor(out) else []:
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._add("backward", "compute", unit.name))

    def _grad_in(self, unit) -> None:
        if unit.name not in self.freed and all(b.full.untyped_storage().nbytes() == 0 for b in unit.buckets):
            self.freed.add(unit.name)
            self._add("backward", "free", unit.name)


def alive_steps(events: list[UnitEvent]) -> tuple[list[int], list[int]]:
    """The lower panel's step curve: ``(xs, alive)`` for ``step="post"``, where the column of
    event x (from x to x + 1, under its mark) shows the gathered bytes just after that event; the
    last value is repeated to close the last column."""
    alive = [e.alive_bytes for e in events]
    return list(range(len(events) + 1)), (alive + alive[-1:] if alive else [0])


def draw_zero3_frame(fig: Figure, sched: Zero3Schedule, upto: int | None = None) -> None:
    """Draw the first ``upto`` events of ``sched`` (None: all) on ``fig``: above, one lane per
    unit with a mark per event (x: event order); below, under each mark, the full parameters
    alive just after that event (bytes, :func:`alive_steps`), the sawtooth, over the shards kept."""
    events = sched.events if upto is None else sched.events[:upto]
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    lane = {name: len(sched.units) - 1 - i for i, name in enumerate(sched.units)}
    n = len(sched.events)
    for x, e in enumerate(events):
        top.barh(lane[e.unit], 0.9, left=x + 0.05, height=0.7, color=KIND_COLORS[e.kind],
                 hatch="//" if e.phase == "backward" else None, edgecolor="white")
    first_backward = next((x for x, e in enumerate(sched.events) if e.phase == "backward"), n)
    for ax in (top, bottom):
        ax.axvline(first_backward, color="0.3", linestyle=":", linewidth=1)
    top.text(first_backward / 2, len(sched.units) - 0.35, "forward", ha="center", fontsize=8)
    top.text((first_backward + n) / 2, len(sched.units) - 0.35, "backward (hatched)", ha="center", fontsize=8)
    top.set_yticks(list(lane.values()), list(lane), fontsize=7)
    top.set_ylim(-0.6, len(sched.units) + 0.1)
    top.set_ylabel("unit")
    xs, alive = alive_steps(events)
    bottom.fill_between(xs, [sched.shard_bytes] * len(xs), color=rank_color(0), alpha=0.35, step="post",
                        label=f"shards kept ({sched.shard_bytes} B)")
    bottom.fill_between(xs, [sched.shard_bytes + a for a in alive], [sched.shard_bytes] * len(xs), step="post",
                        color=KIND_COLORS["gather"], alpha=0.8, label="full parameters gathered")
    bottom.set_ylim(0, sched.shard_bytes + max(e.alive_bytes for e in sched.events) * 1.15)
    bottom.set_xlim(0, n)
    bottom.set_ylabel("parameter bytes")
    bottom.set_xlabel("event of the recorded step (in the order the engine ran them)")
    bottom.legend(fontsize=7, loc="lower right")
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in KINDS]
    top.legend(handles=handles, fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("ZeRO-3 (P_os+g+p): per unit, gather, prefetch, compute, free (recorded from Zero3Engine)",
                 fontsize=9)


def zero3_figure(sched: Zero3Schedule | None = None) -> Figure:
    """The whole recorded step (:func:`zero3_schedule`, default model) as one Figure."""
    sched = zero3_schedule() if sched is None else sched
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    draw_zero3_frame(fig, sched)
    return fig


def zero3_animation(sched: Zero3Schedule | None = None, frames: int = 8):
    """The recorded step revealed in ``frames`` (an integer >= 2) equal slices of its events,
    as a :class:`~zerolearn.figures.animate.StepThrough`."""
    from zerolearn.figures.animate import step_through

    sched = zero3_schedule() if sched is None else sched
    require_count("frames", frames, minimum=2)
    n = len(sched.events)
    cuts = sorted({round(n * (i + 1) / frames) for i in range(frames)})

    def draw(fig: Figure, i: int) -> None:
        draw_zero3_frame(fig, sched, cuts[i])

    captions = [f"events 1-{c} of {n}: {sched.events[c - 1].phase}, {sched.events[c - 1].kind} "
                f"{sched.events[c - 1].unit}" for c in cuts]
    return step_through(draw, len(cuts), figsize=(8.0, 4.2), captions=captions)
