"""A PyTorch user's habits around an engine, at every stage, on 2 and 3 ranks, against one
process on the whole batch: each works exactly, or is refused with a ConfigError that
names what to do instead; none is silently wrong, none a raw torch error."""

import functools

import dropin_jobs
import pytest
import torch
import user_model_jobs

from jobs import on_ranks

pytestmark = pytest.mark.quick

STAGES = (0, 1, 2, 3)
EXACT = ("plain", "loss_backward", "opt_step", "zero_grad_keep", "lambda_lr", "cosine", "retain", "eval_dropout",
         "lora_bf16", "clip_engine", "weight_norm", "spectral_norm", "param_list")
SCENARIOS = (*EXACT, "clip_user", "unfreeze", "compile", "load")


@functools.cache
def runs(world_size: int) -> dict:
    """Every scenario at every stage, in one set of rank processes: (scenario, stage) -> rank 0's, rank 1's."""
    todo = [dict(scenario=s, stage=st) for s in SCENARIOS for st in STAGES]
    out = on_ranks(dropin_jobs.many, world_size, todo)
    return {(kw["scenario"], kw["stage"]): (out[0][k], out[1][k]) for k, kw in enumerate(todo)}


@functools.cache
def reference(scenario: str) -> dict:
    return dropin_jobs.reference(scenario)


def assert_exact(run, ref, what):
    assert not isinstance(run, str), f"{what}: {run}"
    # The frozen bf16 base computes in bf16, and so does the gradient through it: rounded to 8
    # bits of mantissa on a slice of the batch here and on the whole batch in the reference.
    rel = 1e-3 if what.startswith("lora_bf16") else 1e-5
    assert run["losses"] == pytest.approx(ref["losses"], rel=rel), what
    assert user_model_jobs.rel_error(run["params"], ref["params"]) < rel, what


def assert_refused(run, *words):
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    for word in words:
        assert word in run, (word, run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_usual_habits_train_as_one_process(world_size):
    for scenario in EXACT:
        for stage in STAGES:
            r0, _ = runs(world_size)[scenario, stage]
            assert_exact(r0, reference(scenario), f"{scenario}, stage {stage}")
    for stage in STAGES:  # engine.clip_grad_norm_ returns torch's norm, before clipping
        r0, _ = runs(world_size)["clip_engine", stage]
        assert r0["norms"] == pytest.approx(reference("clip_engine")["norms"], rel=1e-5)


@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_on_the_models_parameters_is_exact_at_stage_0_and_refused_where_ranks_hold_shards(world_size):
    ref = reference("clip_user")
    r0, _ = runs(world_size)["clip_user", 0]
    assert_exact(r0, ref, "clip_user, stage 0")
    assert r0["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    for stage in (1, 2, 3):
        assert_refused(runs(world_size)["clip_user", stage][0], "max_grad_norm=", "engine.clip_grad_norm_")


def test_the_engine_reads_as_the_module_it_wraps():
    for stage in STAGES:
        r0, _ = runs(2)["eval_dropout", stage]
        assert r0["training"] == [False, True]
        assert r0["names"] and r0["state_dict_keys"]
    for scenario in ("lambda_lr", "cosine"):  # the scheduler's last lr reached the engine
        ref = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=dropin_jobs.LR)
        sched = dropin_jobs.schedule(scenario, ref)
        for _ in range(dropin_jobs.STEPS):
            ref.step()
            sched.step()
        for stage in STAGES:
            assert runs(2)[scenario, stage][0]["lr"] == pytest.approx(ref.param_groups[0]["lr"])


def test_buffers_keep_their_dtype_and_rank_0s_values():
    for stage in STAGES:
        r0, r1 = runs(2)["plain", stage]
        assert r0["buffers"]["count64"].dtype == torch.float64
        assert r0["buffers"]["count64"].item() == 2.0**30 + dropin_jobs.STEPS  # fp32 would stay at 2^30
        assert r0["buffers"]["f16"].dtype == torch.float16
        assert r0["buffers"]["i16"].dtype == torch.int16
        assert r0["buffers"]["i16"].tolist() == r1["buffers"]["i16"].tolist() == [5, 5]


def test_refused_habits_name_the_parameter_and_the_fix():
    for stage in STAGES:
        assert_refused(runs(2)["unfreeze", stage][0], "mid.weight", "requires_grad")
    for stage in (0, 1, 2):  # stages 0-2: a compiled model and model.load_state_dict train exactly
        assert_exact(runs(2)["compile", stage][0], reference("plain"), f"compile, stage {stage}")
        assert_exact(runs(2)["load", stage][0], reference("plain"), f"load, stage {stage}")
    assert_refused(runs(2)["compile", 3][0], "ZeRO-3", "compile")
    assert_refused(runs(2)["load", 3][0], "engine.load_state_dict")
