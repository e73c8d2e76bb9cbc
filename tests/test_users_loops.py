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
* the model wrapped a second time while the first engine lives (a notebook cell run twice);
* the engine read as a module: ``modules()``, ``named_modules()``, ``children()``,
  ``apply(fn)`` the model's, ``to()`` the engine itself on its device, else refused.
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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_engine_answers_as_the_module_it_wraps(world_size):
    faces = on_ranks(state_jobs.module_faces, world_size, list(STAGES))
    assert len(faces) == world_size
    for rank, per_stage in enumerate(faces):
        for stage, face in zip(STAGES, per_stage, strict=True):
            where = f"stage {stage}, rank {rank}: {face}"
            assert len(face["modules"]) == 5 and all(face["modules"]), where  # the model, then its 4 layers
            assert face["named_modules"] and face["apply_returns_engine"] and face["to_same"], where
            assert len(face["children"]) == 4 and all(face["children"]), where
            assert len(face["apply_visits"]) == 5 and all(face["apply_visits"]), where  # children first, as torch
            assert face["to_dtype"].startswith("ConfigError: engine.to(torch.float64)"), where
            assert face["to_device"].startswith("ConfigError: engine.to('meta')"), where
            assert "move or cast the model before wrapping it" in face["to_device"], where
            assert face["trained"], where


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_backward_that_raises_midway_trains_on_after_zero_grad_else_is_refused(world_size):
    # The user catches the error, then calls zero_grad, or goes on to the next forward or to
    # step, where the buckets hold part of a backward: refused by name, as DDP refuses.
    todo = [dict(stage=s, then=t, how=h) for s in STAGES
            for t, h in (("zero_grad", "loss"), ("zero_grad", "engine"), ("forward", "loss"),
                         ("forward", "engine"), ("step", "loss"))]
    ranks = on_ranks(state_jobs.failed_backwards, world_size, todo)
    ref = state_jobs.failed_backward(None)
    assert ref["said"] == ["boom in backward"]
    for rank, runs in enumerate(ranks):
        for kw, run in zip(todo, runs, strict=True):
            where = f"rank {rank}, {kw}"
            if kw["then"] != "zero_grad":
                assert isinstance(run, str) and run.startswith("ConfigError: the last backward raised before it "
                                                               "ended"), f"{where}: {run}"
                assert "engine.zero_grad()" in run, f"{where}: {run}"
                continue
            assert not isinstance(run, str), f"{where}: {run}"
            assert run["said"] == ["boom in backward"], f"{where}: {run['said']}"
            torch.testing.assert_close(run["params"], ref["params"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, where=where: f"{where}: {m}")
