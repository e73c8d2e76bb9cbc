"""Exercise ``04.nano_engine``'s check: the reader's functions assembled into one engine that
trains (paper Sec 5.1-5.3, Sec 7.2, Fig 1).

The trial first runs, on the same ranks, the own check of every part the reader's engine
uses that is not the book's solution (``02.zero1_step``'s trial for their ``zero1_step``,
and so on): a wrong part is named with its exercise and the words its own check uses.
Then it trains the book's MLP (4 Linear layers of width 64) with Adam for three steps at
each stage 0-3 on 2 and 3 ranks, against one process on the whole batch, and checks the
losses and parameters, the bytes held against Fig 1's (2 + 2 + K) Psi divided by Nd as
each stage divides it (K = 12, padding included), and the elements moved per step against
2 / 2 / 2 / 3 Psi (Sec 7.2).

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch04.nano_engine`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.chapters.ch01 import average_gradients_check, bucket_hook_check  # noqa: F401 - the parts' checks
from zerolearn.chapters.ch02 import shard_range_check, zero1_step_check  # noqa: F401 - register before ours
from zerolearn.chapters.ch03 import reduce_scatter_hook_check  # noqa: F401
from zerolearn.chapters.ch04 import gather_hooks_check, prefetch_check  # noqa: F401
from zerolearn.chapters.ch04.nano_engine import nano_engine
from zerolearn.exercises import core
from zerolearn.exercises.core import EXERCISES, Bug, Exercise, Wrong, agree, register
from zerolearn.exercises.helpers import PARAM_ATOL, WIDTH, mlp
from zerolearn.memory import model as analytic
from zerolearn.nano import NanoZero, reference_parts
from zerolearn.tables import kib

BATCH, STEPS, LR, K = 12, 3, 1e-3, 12
EXERCISE_OF = {"average_gradients": "01.average_gradients", "bucket_hook": "01.bucket_hook",
               "shard_range": "02.shard_range", "zero1_step": "02.zero1_step",
               "reduce_scatter_hook": "03.reduce_scatter_hook", "gather_hooks": "04.gather_hooks",
               "prefetch": "04.prefetch"}
"""Each part of a NanoZero, and the exercise that checks it alone."""
RTOL = 1e-5  # Adam on the MLP: sums over ranks in another order than one process, nothing more


@contextlib.contextmanager
def _own_agreement(name: str):
    """A part's trial run inside this one agrees on steps of its own (a token of its own), and a
    failure in it is posted where the peers, still inside it, wait."""
    outer = core._AGREEMENT
    if outer is not None:
        core._AGREEMENT = core._Agreement(outer.store, f"{outer.token}/{name}", outer.rank, outer.world_size,
                                          first=outer.first)
    try:
        yield
    except BaseException:
        core._post_failure()
        raise
    finally:
        core._AGREEMENT = outer


def _uses(engine: NanoZero) -> list[str]:
    """The parts ``engine``'s stage runs, in the order the chapters build them."""
    stage = engine.stage
    dp = ["average_gradients" if engine.naive else "bucket_hook"] if stage == 0 else []
    rs = ["reduce_scatter_hook"] if stage >= 2 else []
    gather = ["prefetch" if engine.prefetch else "gather_hooks"] if stage == 3 else []
    return [*dp, "shard_range", "zero1_step", *rs, *gather]


def _refuse_unused(engine: NanoZero, references: dict) -> None:
    """A part the reader passed that no stage of this engine runs: its check would answer for
    the book's part instead (``prefetch`` without ``prefetch=True``; ``average_gradients``
    beside ``bucket_hook``)."""
    at_any_stage = {"average_gradients" if engine.naive else "bucket_hook", "shard_range", "zero1_step",
                    "reduce_scatter_hook", "prefetch" if engine.prefetch else "gather_hooks"}
    unused = [part for part, fn in engine.fn.items() if fn is not references[part] and part not in at_any_stage]
    if "prefetch" in unused:
        raise Wrong("you passed parts={'prefetch': ...} but built NanoZero without prefetch=True: stage 3 then "
                    "gathers with gather_hooks and your prefetch never runs; pass prefetch=True")
    if unused:
        raise Wrong(f"you passed parts={{'{unused[0]}': ...}}, which this engine never runs "
                    f"({'bucket_hook' if unused[0] == 'average_gradients' else unused[0]} is used instead); "
                    "pass only the parts the engine uses")


def _check_parts(engine: NanoZero, checked: set[str]) -> None:
    """Run the own trial of every part ``engine`` uses that is not the book's solution and was
    not checked yet (``checked``: exercise names, updated).

    Raises:
        Wrong: a part was passed that the engine never runs (:func:`_refuse_unused`), or a
            part's own trial fails.
    """
    references = reference_parts()
    _refuse_unused(engine, references)
    for part in _uses(engine):
        name = EXERCISE_OF[part]
        if engine.fn[part] is references[part] or name in checked:
            continue
        with _own_agreement(name):
            try:
                EXERCISES[name].trial(engine.fn[part])
            except Wrong as e:
                raise Wrong(f"your {part} (exercise {name}) is wrong: {e}", e.step) from None
        checked.add(name)


def _train(fn, stage: int, ws: int, rank: int, checked: set[str]) -> float:
    """Three Adam steps of the MLP at ``stage`` with the reader's engine against one process: the
    losses, the parameters, the bytes held (Fig 1), the elements moved; returns Psi per step."""
    model, ref = mlp(), mlp()
    engine = fn(model, stage, LR)
    if not isinstance(engine, NanoZero):
        raise Wrong(f"nano_engine returned {type(engine).__name__}; it must return "
                    "zerolearn.nano.NanoZero(model, stage, lr, parts=...)")
    if engine.stage != stage:
        raise Wrong(f"nano_engine(model, {stage}, lr) built a stage-{engine.stage} engine: pass stage on")
    _check_parts(engine, checked)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    comm.LEDGER.reset()
    grads = 0
    for step in range(STEPS):
        x, y = data.mlp_batch(step, BATCH, WIDTH)
        loss = F.mse_loss(engine(data.rank_slice(x, rank, ws)), data.rank_slice(y, rank, ws))
        engine.backward(loss)
        grads = engine.model_state_bytes()["grads"]  # the gradient held after backward (ZeRO-2, -3: shards)
        engine.step()
        engine.zero_grad()
        moved = comm.LEDGER.volume_elements()
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        got = comm.monitor_mean(loss.item())
        if abs(got - want.item()) > RTOL * abs(want.item()):
            raise Wrong(f"stage {stage}: the loss, averaged over the ranks, is {got:.7g}; one process on the whole "
                        f"batch has {want.item():.7g}", step)
        comm.LEDGER.reset()
        n = engine.psi + engine.padding
        per_step = 3 if stage == 3 else 2
        if moved != per_step * n:
            how = ("all-gathers before each unit's forward and backward, and the gradient's reduce-scatter"
                   if stage == 3 else "one all-reduce of the gradient" if stage == 0 else
                   "a reduce-scatter of the gradient and an all-gather of the parameters")
            raise Wrong(f"stage {stage}: your engine moved {moved / n:.2f} Psi in this step; it moves {per_step}.0 "
                        f"Psi: {how} (Sec 7.2)", step)
    params = engine.full_parameters()
    for name, q in ref.named_parameters():
        core.first_difference(f"stage {stage}: parameter {name!r} after {STEPS} steps", params[name], q,
                              step=STEPS - 1, rtol=RTOL, atol=PARAM_ATOL, reference="single-process Adam")
    measured = {**engine.model_state_bytes(), "grads": grads}
    formula = analytic.model_state_bytes(n, ws, stage, k=K, param_bytes=4, grad_bytes=4)
    for what in ("params", "grads", "optimizer_states"):
        if measured[what] != formula[what]:
            raise Wrong(f"stage {stage}: this rank holds {kib(measured[what], unit=True)} of {what}; Fig 1 gives "
                        f"{kib(formula[what], unit=True)} for Psi = {engine.psi:,} (+ {engine.padding} padding) "
                        f"on {ws} ranks, K = {K}", STEPS - 1)
    return moved / n


def _engine_trial(fn) -> str:
    """Stages 0-3 with the reader's engine: their parts' own checks, then training against one process."""
    ctx = zdist.context()
    checked: set[str] = set()
    per_step = []
    for stage in (0, 1, 2, 3):
        per_step.append(_train(fn, stage, ctx.world_size, ctx.rank, checked))
        agree(stage)
    parts = f"; your parts pass their own checks ({', '.join(sorted(checked))})" if checked else ""
    return (f"stages 0-3 train as one process for {STEPS} Adam steps, hold Fig 1's bytes (K = {K}) and move "
            f"{' / '.join(f'{m:.1f}' for m in per_step)} Psi per step{parts}")


def _plugged(part: str, bug_fn, model, stage, lr):
    """The reference engine with one part replaced by a known bug of that part's exercise."""
    return NanoZero(model, stage, lr, parts={part: bug_fn}, prefetch=part == "prefetch")


PLUGGED = (("bucket_hook", "no_divide"), ("shard_range", "always_pad"), ("zero1_step", "allreduce_then_broadcast"),
           ("zero1_step", "bf16_master"), ("reduce_scatter_hook", "keeps_whole_gradient"),
           ("gather_hooks", "never_frees"), ("prefetch", "forward_only"))
"""(part, bug of its exercise) plugged into the engine: each must be named as its own check names it."""


def _bugs() -> dict[str, Bug]:
    bugs = {}
    for part, name in PLUGGED:
        bug = EXERCISES[EXERCISE_OF[part]].bugs[name]
        bugs[f"{part}.{name}"] = Bug(functools.partial(_plugged, part, bug.fn), f"{part} with its bug {name} "
                                     f"({bug.source})", bug.says)
    return bugs


register(Exercise(
    "04.nano_engine", "nano-ZeRO: your functions of chapters 1-4 assembled into an engine that trains",
    nano_engine, _engine_trial, _bugs(), timeout_s=240.0))
