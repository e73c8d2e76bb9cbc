"""A torch user's habits around the engine, each against plain torch in one process on the
whole batch at stages 0-3 on 2 ranks (3 in the slow tier): exact, or a ConfigError that
names the cause, never a hang or a crash.

* Adam with ``amsgrad`` set in ``engine.optimizer.param_groups`` while a parameter sits out
  the first step (the engine then creates the optimizer's state itself);
* a ZeRO-3 unit whose forward returns a view of its own parameter (a positional table);
* ``model.zero_grad()``, the wrapped module's, instead of the engine's;
* clipping the optimizer's params (``engine.optimizer.param_groups``, Lightning's habit):
  exact at stage 0, where they hold the reduced gradient, else refused by name;
* ``torch.amp.GradScaler`` around the engine's optimizer (refused: the engine's own fp16);
* the model wrapped a second time while the first engine lives (a notebook cell run twice).
"""

from __future__ import annotations

import functools

import pytest
import state_jobs
import torch

from jobs import on_ranks

pytestmark = pytest.mark.quick

STAGES = (0, 1, 2, 3)
EXACT = ("amsgrad", "view_unit", "model_zero_grad")
REFUSED = ("grad_scaler", "wrap_twice", "clip_groups")
WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.slow)]


@functools.cache
def runs(world_size: int) -> dict:
    todo = [dict(habit=h, stage=stage) for h in EXACT + REFUSED for stage in STAGES]
    out = on_ranks(state_jobs.habits, world_size, todo)[0]
    assert len(out) == len(todo)
    return {(kw["habit"], kw["stage"]): run for kw, run in zip(todo, out, strict=True)}


@functools.cache
def reference(habit: str) -> dict:
    return state_jobs.habit_reference(habit)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("habit", EXACT)
@pytest.mark.parametrize("stage", STAGES)
def test_the_habit_trains_as_one_process(world_size, habit, stage):
    run, ref = runs(world_size)[(habit, stage)], reference(habit)
    assert not isinstance(run, str), f"{habit} at stage {stage}: {run}"
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert sorted(run["params"]) == sorted(ref["params"])
    torch.testing.assert_close(run["params"], ref["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_clipping_the_optimizers_params_is_exact_where_they_hold_the_gradient_else_refused(world_size, stage):
    run = runs(world_size)[("clip_groups", stage)]
    if stage == 0:  # fp32 DP: the master is the working buffer, its .grad the reduced gradient
        torch.testing.assert_close(run["params"], reference("clip_groups")["params"], rtol=1e-5, atol=1e-6)
    else:
        assert isinstance(run, str) and run.startswith("ConfigError: p.grad was read"), run
        assert "masters get their gradient only inside engine.step()" in run and "max_grad_norm=" in run, run


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_grad_scaler_is_refused_naming_the_engines_fp16(world_size, stage):
    run = runs(world_size)[("grad_scaler", stage)]
    assert isinstance(run, str) and run.startswith("ConfigError") and 'dtype="fp16"' in run, run


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_wrapping_a_wrapped_model_is_refused_naming_close(world_size, stage):
    run = runs(world_size)[("wrap_twice", stage)]
    assert isinstance(run, str) and run.startswith("ConfigError") and "engine.close()" in run, run
