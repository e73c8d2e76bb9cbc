"""The engine's optimizer as a torch user expects it, each habit against plain torch in one
process on the whole batch, at stages 0-3 on 2 ranks (3 in the slow tier): torch's options
passed through (``nesterov``, ``maximize``, ``eps``, ``amsgrad``, ``lr=0``), an input's
gradient through ``backward(inputs=...)`` before the training backward, value clipping where
``p.grad`` is the reduced gradient; ``engine.optimizer.state[p]`` for a model parameter; the
DDP checkpoint habit (every rank takes the whole state, rank 0 saves it, every rank loads it
into an engine with other buckets); a plain torch optimizer's state loaded into an engine.
Then the refusals, each naming its cause: dampening, the user's own torch optimizer over the
model's parameters, another rank's shards, an embedding with max_norm, an uninitialised lazy
module, value clipping of a sharded gradient; and a rank that skips its backward for a NaN
loss, which ends at the collective timeout naming the collective (and in debug mode the rank).
"""

from __future__ import annotations

import functools

import pytest
import state_jobs
import torch

from jobs import on_ranks
from zerolearn.dist import launch
from zerolearn.ranks import RankError

pytestmark = pytest.mark.quick
STAGES = (0, 1, 2, 3)
EXACT = tuple(state_jobs.OPTIMIZER_HABITS)
REFUSED = ("dampening_kwarg", "dampening_group", "users_optimizer", "other_ranks_shards", "embedding_max_norm",
           "lazy", "clip_value")
WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.slow)]


@functools.cache
def runs(world_size: int) -> dict:
    todo = [dict(kind="exact", habit=h, stage=s) for h in EXACT for s in STAGES]
    todo += [dict(kind="refused", habit=h, stage=s) for h in REFUSED for s in STAGES]
    todo += [dict(kind="refused", habit=h, stage=s)
             for h in ("clip_groups_offload", "clip_groups_dpu") for s in (1, 2, 3)]
    keys = [(kw["habit"], kw["stage"], kw["kind"]) for kw in todo]
    out = on_ranks(state_jobs.optimizer_habits, world_size, todo)
    assert len(out) == world_size and all(len(r) == len(todo) for r in out)
    return {key: [r[i] for r in out] for i, key in enumerate(keys)}


@functools.cache
def reference(habit: str) -> dict:
    return state_jobs.optimizer_reference(habit)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("habit", EXACT)
@pytest.mark.parametrize("stage", STAGES)
def test_the_optimizer_habit_trains_as_one_process(world_size, habit, stage):
    if habit == "clip_value" and stage > 0:
        pytest.skip("value clipping of a sharded gradient is refused (test_the_refusal_names_its_cause)")
    run, ref = runs(world_size)[(habit, stage, "exact")][0], reference(habit)
    assert not isinstance(run, str), f"{habit} at stage {stage}: {run}"
    assert run["losses"] == pytest.approx(ref["losses"][-len(run["losses"]):], rel=1e-5)
    assert sorted(run["params"]) == sorted(ref["params"])
    torch.testing.assert_close(run["params"], ref["params"], rtol=1e-5, atol=1e-6)
    # Every step reduces alike (ZeRO-3's gathers follow its schedule, which learns the unit step 0 left out).
    steps = [{op: n for op, n in s.items() if op != "all_gather"} for s in run["steps"]]
    assert len(steps) == len(run["losses"]) and steps[-1] and all(s == steps[-1] for s in steps[1:]), steps
    if habit == "inputs_backward":  # no reduction; ZeRO-3 gathers the weights the input's gradient needs
        assert run["aside"] == {} if stage < 3 else set(run["aside"]) == {"all_gather"}, run["aside"]
    if habit == "resume":
        assert run["buckets"] != run["buckets_before"] or stage == 3, "the resume loaded into the same buckets"


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_state_of_a_model_parameter_is_this_ranks_part_of_torchs(stage):
    ranks = runs(2)[("maximize", stage, "exact")]
    ref = reference("maximize")["state"]
    held = [r["state"] for r in ranks]
    assert all(len(h) == len(ref) for h in held) and sum(t is not None for t in ref) == 6  # side's 2 sat out
    for i, want in enumerate(ref):
        parts = [h[i] for h in held if h[i] is not None]
        if want is None:  # torch has no state for a parameter never stepped; nor has the engine
            assert parts == [], f"parameter {i}"
            continue
        assert parts, f"parameter {i}: no rank holds its state"
        if stage == 0:
            assert len(parts) == 2
            for part in parts:
                torch.testing.assert_close(part, want)
            continue
        flat = want.reshape(-1)
        together = torch.cat([p.reshape(-1) for p in parts])  # ranks hold consecutive parts, in rank order
        assert together.numel() == flat.numel(), f"parameter {i}: {together.numel()} of {flat.numel()} held"
        torch.testing.assert_close(together, flat)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("habit", REFUSED)
def test_the_refusal_names_its_cause(world_size, stage, habit):
    said = runs(world_size)[(habit, stage, "refused")]
    words = {"dampening_kwarg": "optimizer_kwargs dampening=0.5", "dampening_group": "param_groups[0]['dampening']",
             "users_optimizer": "engine.optimizer", "other_ranks_shards": "holds rank 0's shards",
             "embedding_max_norm": "max_norm=None", "lazy": "uninitialised lazy parameter",
             "clip_value": "clip_grad_value_"}[habit]
    if habit == "clip_value" and stage == 0:  # p.grad is the reduced gradient: exact (the exact test)
        assert said == ["trained"] * world_size
        return
    for rank, text in enumerate(said):
        if habit == "other_ranks_shards" and rank == 0:
            assert text == "trained", text  # its own shards load
            continue
        assert text.startswith("ConfigError") and words in text, f"rank {rank}: {text}"


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "debug"), [(0, False), (0, True), (3, False), (3, True)])
def test_a_rank_that_skips_backward_ends_at_the_timeout_naming_the_collective(monkeypatch, stage, debug):
    monkeypatch.setenv("ZEROLEARN_REPORT_GRACE", "1")
    if debug:
        monkeypatch.setenv("ZEROLEARN_DEBUG_COLLECTIVES", "1")
    with pytest.raises(RankError) as info:
        launch(state_jobs.nan_skip, 2, stage, 4.0, timeout_s=120)
    message = str(info.value)
    if stage == 3 and debug:  # the units' agreement sees one rank a forward ahead
        assert "ConfigError" in message and "a rank skipped a forward, a backward or a step" in message, message
        return
    if stage == 3:  # forward's and backward's gathers on twin groups: each rank waits, none is ended by gloo
        assert "CollectiveError" in message and "all_gather #" in message, message
        assert "SIGABRT" not in message and "exited with code" not in message, message
        return
    assert "CollectiveError" in message and "rank 1 posted nothing" in message, message
    assert ("fingerprint exchange" if debug else "all_reduce #") in message, message


def test_bf16_casts_keyword_and_dict_inputs_as_positional_ones():
    todo = [dict(kind=k, stage=s) for k in ("kw", "positional") for s in STAGES]
    out = on_ranks(state_jobs.many_bf16, 2, todo)[0]
    assert len(out) == len(todo)
    got = {(kw["kind"], kw["stage"]): run for kw, run in zip(todo, out, strict=True)}
    for stage in STAGES:  # a keyword-only forward returning a dict trains as the positional one, bit for bit
        assert not isinstance(got[("kw", stage)], str), got[("kw", stage)]
        assert got[("kw", stage)] == got[("positional", stage)], stage


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["resnet", "wav2vec2"])
def test_hugging_face_models_with_keyword_batches_train_in_bf16(kind):
    pytest.importorskip("transformers")
    out = on_ranks(state_jobs.many_bf16, 2, [dict(kind=kind, stage=s) for s in STAGES])[0]
    ref = state_jobs.bf16_batches(kind, None)  # fp32, one process
    assert len(out) == len(STAGES)
    for stage, losses in zip(STAGES, out, strict=True):
        assert not isinstance(losses, str), f"stage {stage}: {losses}"
        assert losses == pytest.approx(ref, rel=2e-2), f"stage {stage}: bf16 {losses}, fp32 {ref}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("habit", ["clip_groups_offload", "clip_groups_dpu"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_the_optimizers_host_masters_under_offload_is_refused(world_size, habit, stage):
    said = runs(world_size)[(habit, stage, "refused")]
    assert len(said) == world_size
    for text in said:  # the host masters hold no gradient before the step (it was a norm of 0.0)
        assert text.startswith("ConfigError: p.grad was read") and "max_grad_norm=" in text, text


def test_a_gradient_penalty_is_exact_at_stages_0_to_2_and_refused_by_name_at_zero3():
    ranks = on_ranks(state_jobs.many_penalties, 2, list(STAGES))
    ref = state_jobs.gradient_penalty(None)["params"]
    assert len(ranks) == 2 and all(len(r) == len(STAGES) for r in ranks)
    for stage, run in zip(STAGES, ranks[0], strict=True):
        if stage == 3:
            assert run["error"].startswith("ConfigError") and "gradient penalty" in run["error"], run
            continue
        assert "error" not in run, f"stage {stage}: {run}"
        torch.testing.assert_close(run["params"], ref, rtol=1e-5, atol=1e-6)
