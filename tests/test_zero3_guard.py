"""ZeRO-3 never computes on a parameter whose all-gather has not finished.

Each model reads parameters the way some users' models do: the parent reads the next
unit's weight (which ZeRO-3 has only prefetched), uses a child's weight through
``torch.matmul`` or adds its bias after the child returned, units return a dataclass,
``nn.TransformerEncoder`` is the whole model (its layers are an ``nn.ModuleList``), a
branch runs on rank 0 only, a unit's output is used on rank 0 only. Every case either
trains exactly as one process on the whole batch, or stops with a ConfigError that
names the parameter (or the ranks), its unit and the fix, and the ranks go on to the
next case in the same process group: no garbage, no crash, no hang. All cases run inside one set of rank processes.
A branch taken on some ranks only is named by the ranks' agreement checks, which run in
debug mode (``ZEROLEARN_DEBUG_COLLECTIVES=1``); a read outside a unit is refused in any mode.
"""

import functools

import pytest
import user_model_jobs
from torch import nn

from jobs import on_ranks
from zerolearn.engines import Zero3Engine
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.quick

STAGES = (0, 1, 2, 3)
SGD = dict(optimizer="sgd", momentum=0.9, lr=0.05)
# (kind, stage, extra options): an error case is always followed by one that trains.
CASES = [(kind, stage, {}) for kind in ("reads_next", "reads_child", "reads_child_bias", "dataclass_units",
                                        "encoder_only") for stage in STAGES]
CASES += [("reads_next", 3, {"no_grad_first": True}), ("dataclass_units", 3, {}),
          ("branchy", 3, {"branch": "rank0"}), ("dataclass_units", 3, {}),
          ("branch_discarded", 3, {"branch": "rank0"}), ("dataclass_units", 3, {}),
          ("dataclass_units", 3, {"units": ["blocks"]}), ("dataclass_units", 3, {})]
CASES += [("reordered", 3, {}), ("branchy", 3, {"branch": "odd_steps"}), ("branchy", 3, {"branch": "rank0_at_2"}),
          ("dataclass_units", 3, {}), ("extra_last", 3, {"branch": "rank0"}), ("dataclass_units", 3, {}),
          ("extra_last", 3, {"branch": "rank0_at_2"}), ("nested", 3, {})]
CASES += [("mixed_dtypes", stage, {}) for stage in STAGES]
# With 1 MiB buckets these models' units are small enough that a prefetch gathers several
# in one all_gather (FUSED); ALONE: the same one unit at a time (prefetch_mb=0, Sec 5.3).
FUSED, ALONE = {"bucket_mb": 1.0}, {"bucket_mb": 1.0, "fuse": False}
CASES += [("reordered", 3, FUSED), ("reordered", 3, ALONE), ("branchy", 3, {**FUSED, "branch": "odd_steps"}),
          ("branchy", 3, {**FUSED, "branch": "rank0_at_2"}), ("dataclass_units", 3, FUSED),
          ("extra_last", 3, {**FUSED, "branch": "rank0_at_2"}), ("dataclass_units", 3, FUSED),
          ("nested", 3, FUSED)]
REFUSED = {"reads_next": "b.weight (unit 2: b, Linear)", "reads_child": "mix.weight (unit 1: mix, Linear)",
           "reads_child_bias": "mix.bias (unit 1: mix, Linear)"}


@functools.cache
def reference(kind: str, branch: str | None = None) -> dict:
    return user_model_jobs.train(kind, None, branch=branch, **SGD)


@functools.cache
def runs() -> list:
    # A branch taken on some ranks only is named by the ranks' agreement checks: debug mode.
    return on_ranks(user_model_jobs.many, 2, [dict(kind=kind, stage=stage, **SGD, **extra, debug="branch" in extra)
                                              for kind, stage, extra in CASES])[0]


def results(kind: str, extra: dict | None = None) -> list:
    return [(stage, run) for (k, stage, e), run in zip(CASES, runs(), strict=True)
            if k == kind and (extra is None or e == extra)]


def assert_exact(kind: str, stage: int, run, branch: str | None = None) -> None:
    assert not isinstance(run, str), f"{kind} at stage {stage}: {run}"
    ref = reference(kind, branch)
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6), f"{kind} at stage {stage}"
    assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-6, f"{kind} at stage {stage}"


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_parameter_read_outside_its_unit_is_refused_by_name_before_any_arithmetic(kind):
    for stage, run in results(kind):
        if stage < 3:
            assert_exact(kind, stage, run)
            continue
        assert isinstance(run, str) and run.startswith("ConfigError"), run
        assert REFUSED[kind] in run and "units=" in run, run
    if kind == "reads_next":  # evaluation first: garbage under no_grad before, now the same error
        (_, run), = results(kind, {"no_grad_first": True})
        assert run.startswith("ConfigError") and "prefetched" in run and REFUSED[kind] in run, run


@pytest.mark.parametrize("kind", ["dataclass_units", "encoder_only"])
def test_units_returning_dataclasses_and_module_lists_train_as_one_process(kind):
    runs_ = results(kind, {})
    assert [stage for stage, _ in runs_][:4] == list(STAGES)
    for stage, run in runs_:
        assert_exact(kind, stage, run)


def test_a_branch_taken_on_one_rank_only_is_named_at_once_at_zero_3():
    (_, run), = results("branchy", {"branch": "rank0"})
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    assert "rank 0 runs unit 2: branch" in run and "rank 1 runs unit 3: head" in run and "units=" in run, run


def test_units_run_in_another_order_than_registered_train_as_one_process_and_become_the_schedule():
    # ZeRO-3 prefetches, in each forward, the unit that came next in the last forward all ranks
    # agreed on (at first, the order of units=): a model that runs its units in another order,
    # or takes a branch on every rank at some steps, trains exactly; the order it ran last is
    # what the next forward prefetches.
    (_, run), = results("reordered", {})
    assert_exact("reordered", 3, run)
    assert run["schedule"] == ["emb", "trunk", "head"], run["schedule"]
    (_, run), = results("branchy", {"branch": "odd_steps"})
    assert_exact("branchy", 3, run, branch="odd_steps")
    assert run["schedule"] == ["emb", "trunk", "head"], run["schedule"]  # step 2 ran no branch


def test_a_branch_one_rank_takes_after_the_schedule_is_learnt_is_named_at_zero_3():
    (_, run), = results("branchy", {"branch": "rank0_at_2"})
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    assert "rank 0 runs unit 2: branch, Linear; rank 1 runs unit 3: head, Linear" in run, run


@pytest.mark.parametrize("branch", ["rank0", "rank0_at_2"])
def test_a_rank_that_runs_one_more_unit_than_another_is_named_at_zero_3(branch):
    # rank0: in the first forward (every unit agreed on before it runs); rank0_at_2: at step 2,
    # when only the forward's end is exchanged and rank 0 first replays the others' gathers.
    (_, run), = results("extra_last", {"branch": branch})
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    assert "rank 0 runs unit 2: branch, Linear; rank 1 ends its forward" in run, run


def test_a_unit_run_inside_another_trains_as_one_process_agreeing_on_every_unit():
    (_, run), = results("nested", {})
    assert_exact("nested", 3, run)
    assert run["schedule"] is None  # units inside units: no schedule, every unit agreed on before it runs


def test_ranks_exchange_nothing_by_default_and_agree_on_every_unit_in_debug_mode():
    # Without debug mode the ranks exchange nothing to agree on units. In debug mode every
    # forward of the small GPT's 5 units (embedding, 3 blocks, head) agrees on each unit and on
    # its end (6 exchanges), and each backward on the units that get gradients (1).
    plain = on_ranks(user_model_jobs.proposals_per_forward, 2)
    assert plain[0] == plain[1] == [0, 0, 0], plain
    counts = on_ranks(user_model_jobs.proposals_per_forward, 2, debug=True)
    assert counts[0] == counts[1] == [6 + 1] * 3, counts


def test_a_unit_whose_output_one_rank_discards_is_named_in_backward_at_zero_3():
    # Every rank runs the unit, so forward agrees; its gradients exist on rank 0 only.
    (_, run), = results("branch_discarded")
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    assert "compute gradients for different units (unit 2: branch, Linear on rank 0 only)" in run, run
    assert "units=" in run, run


def test_small_units_prefetched_together_in_one_all_gather_train_as_one_process():
    # A prefetch gathers the following units up to prefetch_mb (and a bucket) in one fused
    # all_gather: the same elements as one unit at a time in fewer calls, the same numbers.
    (_, fused), = results("reordered", FUSED)
    (_, alone), = results("reordered", ALONE)
    assert_exact("reordered", 3, fused)
    assert_exact("reordered", 3, alone)
    assert fused["schedule"] == alone["schedule"] == ["emb", "trunk", "head"]
    assert fused["all_gather"][1] == alone["all_gather"][1], (fused["all_gather"], alone["all_gather"])
    assert fused["all_gather"][0] < alone["all_gather"][0], (fused["all_gather"], alone["all_gather"])
    for kind, extra in (("branchy", {**FUSED, "branch": "odd_steps"}), ("dataclass_units", FUSED),
                        ("nested", FUSED)):
        for _, run in results(kind, extra):
            assert_exact(kind, 3, run, branch=extra.get("branch"))


@pytest.mark.parametrize("kind", ["branchy", "extra_last"])
def test_a_rank_that_leaves_the_schedule_is_named_when_prefetches_are_fused(kind):
    # The rank off the schedule replays the others' fused gathers, so every collective
    # pairs; the case after it trains in the same process group.
    (_, run), = results(kind, {**FUSED, "branch": "rank0_at_2"})
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    other = "rank 1 runs unit 3: head, Linear" if kind == "branchy" else "rank 1 ends its forward"
    assert f"rank 0 runs unit 2: branch, Linear; {other}" in run, run
    assert all(not isinstance(run, str) for _, run in results("dataclass_units", FUSED))


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "4"])
def test_a_bad_prefetch_mb_is_refused_before_any_work(bad):
    # Checked before the engine reads the process group (there is none here) or allocates.
    with pytest.raises(ConfigError, match=r"prefetch_mb .*: must be a finite number >= 0"):
        Zero3Engine(nn.Linear(2, 2), prefetch_mb=bad)


def test_a_module_list_passed_as_a_unit_is_refused_before_work():
    (_, run), = results("dataclass_units", {"units": ["blocks"]})
    assert run.startswith("ConfigError") and "blocks (ModuleList)" in run and "units=" in run, run


def test_parameters_of_two_other_dtypes_are_refused_by_name_at_every_stage():
    runs_ = results("mixed_dtypes")
    assert [stage for stage, _ in runs_] == list(STAGES)
    for stage, run in runs_:
        assert isinstance(run, str) and run.startswith("ConfigError"), f"stage {stage}: {run}"
        assert "float64: scale" in run and "bfloat16: shift" in run, run
