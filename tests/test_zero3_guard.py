"""ZeRO-3 never computes on a parameter whose all-gather has not finished.

Each model reads parameters the way some users' models do: the parent reads the next
unit's weight (which ZeRO-3 has only prefetched), uses a child's weight through
``torch.matmul`` or adds its bias after the child returned, units return a dataclass,
``nn.TransformerEncoder`` is the whole model (its layers are an ``nn.ModuleList``), a
branch runs on rank 0 only, a unit's output is used on rank 0 only. Every case either
trains exactly as one process on the whole batch, or stops with a ConfigError that
names the parameter (or the ranks), its unit and the fix, and the ranks go on to the
next case in the same process group: no garbage, no crash, no hang. All cases run inside one set of rank processes.
"""

import functools

import pytest
import user_model_jobs

from jobs import on_ranks

STAGES = (0, 1, 2, 3)
SGD = dict(optimizer="sgd", momentum=0.9, lr=0.05)
# (kind, stage, extra options): an error case is always followed by one that trains.
CASES = [(kind, stage, {}) for kind in ("reads_next", "reads_child", "reads_child_bias", "dataclass_units",
                                        "encoder_only") for stage in STAGES]
CASES += [("reads_next", 3, {"no_grad_first": True}), ("dataclass_units", 3, {}),
          ("branchy", 3, {"branch": "rank0"}), ("dataclass_units", 3, {}),
          ("branch_discarded", 3, {"branch": "rank0"}), ("dataclass_units", 3, {}),
          ("dataclass_units", 3, {"units": ["blocks"]}), ("dataclass_units", 3, {})]
CASES += [("mixed_dtypes", stage, {}) for stage in STAGES]
REFUSED = {"reads_next": "b.weight (unit 2: b, Linear)", "reads_child": "mix.weight (unit 1: mix, Linear)",
           "reads_child_bias": "mix.bias (unit 1: mix, Linear)"}


@functools.cache
def reference(kind: str) -> dict:
    return user_model_jobs.train(kind, None, **SGD)


@functools.cache
def runs() -> list:
    return on_ranks(user_model_jobs.many, 2, [dict(kind=kind, stage=stage, **SGD, **extra)
                                              for kind, stage, extra in CASES])[0]


def results(kind: str, extra: dict | None = None) -> list:
    return [(stage, run) for (k, stage, e), run in zip(CASES, runs()) if k == kind and (extra is None or e == extra)]


def assert_exact(kind: str, stage: int, run) -> None:
    assert not isinstance(run, str), f"{kind} at stage {stage}: {run}"
    ref = reference(kind)
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
    for stage, run in results(kind, {}):
        assert_exact(kind, stage, run)


def test_a_branch_taken_on_one_rank_only_is_named_at_once_at_zero_3():
    (_, run), = results("branchy")
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    assert "rank 0 runs unit 2: branch" in run and "rank 1 runs unit 3: head" in run and "units=" in run, run


def test_a_unit_whose_output_one_rank_discards_is_named_in_backward_at_zero_3():
    # Every rank runs the unit, so forward agrees; its gradients exist on rank 0 only.
    (_, run), = results("branch_discarded")
    assert isinstance(run, str) and run.startswith("ConfigError"), run
    assert "compute gradients for different units (unit 2: branch, Linear on rank 0 only)" in run, run
    assert "units=" in run, run


def test_a_module_list_passed_as_a_unit_is_refused_before_work():
    (_, run), = results("dataclass_units", {"units": ["blocks"]})
    assert run.startswith("ConfigError") and "blocks (ModuleList)" in run and "units=" in run, run


def test_parameters_of_two_other_dtypes_are_refused_by_name_at_every_stage():
    for stage, run in results("mixed_dtypes"):
        assert isinstance(run, str) and run.startswith("ConfigError"), f"stage {stage}: {run}"
        assert "float64: scale" in run and "bfloat16: shift" in run, run
