"""One training state: a backward begins where it reaches the model's outputs and ends once,
whatever called it, and a backward that reaches no parameter moves nothing.

Each scenario runs at stages 0-3 on 2 ranks (and 3 in the slow tier) against plain torch in
one process on the whole batch: an input's gradient through ``torch.autograd.grad`` between
forward and backward, ``model(x)`` with a reentrant activation checkpoint instead of
``engine(x)``, ``zero_grad(set_to_none=False)`` with a parameter the later steps leave
unused (SGD momentum and Adam step it with a zero gradient), ``p.grad.data`` read between
backward and step, and ``loss.backward(create_graph=True)``.
"""

from __future__ import annotations

import functools

import pytest
import state_jobs
import torch

from jobs import on_ranks

pytestmark = pytest.mark.quick

STAGES = (0, 1, 2, 3)
CASES = [("input_grad", "sgd"), ("reentrant", "sgd"), ("zero_grad_keep", "sgd"), ("zero_grad_keep", "adam"),
         ("grad_data", "sgd"), ("create_graph", "sgd"), ("plain", "sgd")]


@functools.cache
def runs(world_size: int) -> dict:
    todo = [dict(scenario=s, stage=stage, optimizer=o) for s, o in CASES for stage in STAGES]
    out = on_ranks(state_jobs.many, world_size, todo)[0]
    assert len(out) == len(todo)
    return {(kw["scenario"], kw["optimizer"], kw["stage"]): run for kw, run in zip(todo, out, strict=True)}


@functools.cache
def reference(scenario: str, optimizer: str) -> dict:
    return state_jobs.reference(scenario, optimizer)


def assert_exact(run, scenario: str, optimizer: str = "sgd", where: str = "") -> None:
    assert not isinstance(run, str), f"{where}: {run}"
    ref = reference(scenario, optimizer)
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), where
    assert sorted(run["params"]) == sorted(ref["params"]), where
    torch.testing.assert_close(run["params"], ref["params"], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_an_input_gradient_moves_no_reduction_and_the_next_step_is_exact(world_size, stage):
    run = runs(world_size)[("input_grad", "sgd", stage)]
    assert_exact(run, "input_grad", where=f"stage {stage}")
    for aside in run["aside"]:  # what torch.autograd.grad(loss, x) booked
        assert "all_reduce" not in aside and "reduce_scatter" not in aside, aside
        if stage < 3:
            assert aside == {}, aside
        else:  # ZeRO-3 gathers the units backward needs to reach x (their weights), and reduces nothing
            assert set(aside) <= {"all_gather"}, aside
    # and the rest of the step (forward, the training backward) books what a plain step books
    plain = runs(world_size)[("plain", "sgd", stage)]
    rest = [{op: n - aside.get(op, 0) for op, n in booked.items()}
            for booked, aside in zip(run["steps"], run["aside"], strict=True)]
    assert len(rest) == state_jobs.STEPS and rest == plain["steps"], (rest, plain["steps"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_model_called_itself_with_a_reentrant_checkpoint_reduces_each_bucket_once(world_size, stage):
    run = runs(world_size)[("reentrant", "sgd", stage)]
    assert_exact(run, "reentrant", where=f"stage {stage}")
    reductions = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter", 3: "reduce_scatter"}[stage]
    for booked in run["steps"]:  # one reduction per bucket per step, as engine(x) books
        assert booked.get(reductions) == run["buckets"], (booked, run["buckets"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_keeping_zeros_steps_an_unused_parameter_as_torch_does(world_size, optimizer, stage):
    run = runs(world_size)[("zero_grad_keep", optimizer, stage)]
    assert_exact(run, "zero_grad_keep", optimizer, where=f"stage {stage}, {optimizer}")
    moved = reference("zero_grad_keep", optimizer)["params"]["side.weight"]
    first = state_jobs.Net().side.weight.detach()
    assert not torch.equal(moved, first)  # the case tests something: torch moved the unused parameter


@pytest.mark.parametrize("stage", STAGES)
def test_reading_p_grad_data_is_refused_where_no_rank_holds_the_gradient(stage):
    run = runs(2)[("grad_data", "sgd", stage)]
    if stage == 0:  # p.grad is the reduced gradient itself (DDP's gradient_as_bucket_view)
        assert isinstance(run, dict) and run["read"] > 0, run
    else:
        assert isinstance(run, str) and run.startswith("ConfigError: p.grad was read (data)"), run


@pytest.mark.parametrize("stage", STAGES)
def test_create_graph_through_loss_backward_is_refused_by_name(stage):
    run = runs(2)[("create_graph", "sgd", stage)]
    assert isinstance(run, str) and run.startswith("ConfigError: backward with create_graph=True"), run


def test_the_plain_loop_is_exact_at_every_stage():
    for stage in STAGES:
        assert_exact(runs(2)[("plain", "sgd", stage)], "plain", where=f"stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_torchs_comm_debug_mode_counts_the_collectives_the_ledger_books(stage):
    # ZeRO-3 is left out: CommDebugMode's module tracker reads each module's parameters
    # before its forward, where the engine refuses a read of a parameter not gathered.
    # On gloo a reduce-scatter runs as an all-reduce (comm.reduce_scatter: gloo's own does so
    # too), and ZeRO-1/2 exchange the used-parameter flags in one more all_reduce that the
    # ledger leaves out as bookkeeping (DDP's too); stage 0 reads them from the reduced gradient.
    ranks = on_ranks(state_jobs.counted_by_torch, 2, stage)
    assert len(ranks) == 2
    for counted in ranks:
        booked = dict(counted["ledger"])
        expected = {"all_reduce": booked.pop("all_reduce", 0) + booked.pop("reduce_scatter", 0) + (stage > 0),
                    **booked}
        assert counted["ledger"] and counted["torch"] == expected, counted
