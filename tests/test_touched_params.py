"""Parameters touched outside the engine's forward: read, changed, loaded, replaced, cast.

Torch lets a user read a weight between steps (log its norm), change it in place (clamp
it after the step), load a state dict into the model, or replace a module. Under the
engines a parameter is a view of a bucket and, at ZeRO-3, holds no elements between its
unit's gathers. Each case either works as in torch (against one process doing the same)
or raises a ConfigError naming the parameter and the fix, at every stage, at 2 and 3
ranks: never a crash, never a change silently lost.
"""

import functools

import pytest
import torch
import touch_jobs

from jobs import on_ranks

pytestmark = pytest.mark.quick

STAGES = (0, 1, 2, 3)


def close(run: dict, ref: dict) -> None:
    assert sum(run["losses"]) == pytest.approx(sum(ref["losses"]), rel=1e-5)
    for name, value in ref["params"].items():
        assert torch.allclose(run["params"][name], value, rtol=1e-4, atol=1e-6), name


@functools.cache
def results(world_size: int) -> dict:
    calls = [("clamped", (stage, "summon")) for stage in STAGES]
    calls += [("clamped", (stage, "direct")) for stage in (0, 1, 2)]
    calls += [("outside_reads", (3,)), ("outside_reads", (1,))]
    calls += [("loaded", (stage,)) for stage in STAGES]
    calls += [("replaced", (stage, what)) for stage in STAGES for what in ("module", "parameter")]
    calls += [("replaced", (stage, "cast", "bf16")) for stage in STAGES]
    calls += [("refused_at_wrap", (stage, kind)) for stage in (0, 3) for kind in ("complex", "sparse")]
    calls += [("sparse_functional", (2,))]
    out = on_ranks(touch_jobs.many, world_size, calls)
    return {"calls": calls, "ranks": out}


def find(world_size: int, name: str, *args) -> list:
    r = results(world_size)
    assert len(r["ranks"]) == world_size
    i = r["calls"].index((name, args))
    return [rank_out[i] for rank_out in r["ranks"]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_weights_clamped_after_each_step_train_as_one_process(world_size):
    # Inside summon_full_params at every stage; in place on the parameter at stages 0-2,
    # where every rank holds the working parameters (the change reaches the master).
    ref = touch_jobs.reference("clamp")
    for stage, how in [(s, "summon") for s in STAGES] + [(s, "direct") for s in (0, 1, 2)]:
        runs = find(world_size, "clamped", stage, how)
        run = {"losses": [sum(r["losses"][i] for r in runs) for i in range(touch_jobs.STEPS)],
               "params": runs[0]["params"]}
        close(run, ref)
        assert run["params"]["mix.weight"].abs().max() <= 0.05 + 1e-7, (stage, how)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero3_parameters_read_between_steps_raise_the_fix_not_a_crash(world_size):
    for out in find(world_size, "outside_reads", 3):
        for case in ("norm", "clamp", "data_clamp", "l2"):
            assert out[case] is not None and out[case].startswith("ConfigError"), (case, out[case])
            assert "mix.weight" in out[case] and "summon_full_params" in out[case], case
        # torch's load_state_dict gathers its copies' errors into one RuntimeError
        assert out["load"] is not None and "ZeRO-3: parameter" in out["load"] and "summon_full_params" in out["load"]
        assert "weight_decay" in out["l2"]
        assert out["repr"] is None  # repr says what the parameter holds, reads nothing
        assert out["then_step"] is None  # the refusals left the engine able to train
        assert out["norm_inside"] == pytest.approx(out["norm_full"], rel=1e-6)


def test_at_stages_0_to_2_the_same_reads_work_as_in_torch():
    for out in find(2, "outside_reads", 1):
        for case in ("norm", "clamp", "load", "data_clamp", "repr", "l2", "then_step"):
            assert out[case] is None, (case, out[case])


@pytest.mark.parametrize("world_size", [2, 3])
def test_engine_load_state_dict_equals_loading_before_wrapping(world_size):
    for stage in STAGES:
        run = find(world_size, "loaded", stage)[0]
        assert run["engine"]["loss"] == pytest.approx(run["before"]["loss"], rel=1e-6), stage
        for name, value in run["before"]["params"].items():
            assert torch.equal(run["engine"]["params"][name], value), (stage, name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_or_module_replaced_or_cast_after_wrapping_is_named_before_the_step(world_size):
    for stage in STAGES:
        for what, name in (("module", "head.weight"), ("parameter", "mix.weight")):
            for err in find(world_size, "replaced", stage, what):
                assert err is not None and err.startswith("ConfigError"), (stage, what, err)
                assert name in err and "before building the engine" in err, (stage, what, err)
        for err in find(world_size, "replaced", stage, "cast", "bf16"):
            assert err is not None and err.startswith("ConfigError"), (stage, err)
            assert "head.classifier.weight" in err and "inside forward" in err, (stage, err)


def test_complex_parameters_and_sparse_gradients_are_refused_with_the_fix():
    for stage in (0, 3):
        err = find(2, "refused_at_wrap", stage, "complex")[0]
        assert err.startswith("ConfigError") and "w" in err and "view_as_real" in err
        err = find(2, "refused_at_wrap", stage, "sparse")[0]
        assert err.startswith("ConfigError") and "0: an embedding with sparse=True" in err and "sparse=False" in err
    err = find(2, "sparse_functional", 2)[0]
    assert err is not None and "table" in err and "sparse=False" in err
