"""Parameters unused in a step follow torch at every stage.

A parameter no rank used gets no update at all, as torch.optim leaves one whose
``.grad`` is None: no momentum, no Adam moment or step count, no weight decay (the
reference is one process on the whole batch). One used by some ranks only gets the
average with zeros from the others, as torch DDP with ``find_unused_parameters=True``.
"""

import functools

import pytest
import torch
import user_model_jobs

from jobs import on_ranks

pytestmark = pytest.mark.quick

STAGES = (0, 1, 2, 3)
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, lr=0.05),
              "adam": dict(optimizer="adam", lr=0.05),
              "adamw": dict(optimizer="adamw", lr=0.05, weight_decay=0.1)}
# "never": the branch is unused on every rank in every step; "odd_steps": used in steps
# 1 and 3 only, so its Adam step count falls behind the rest of its flat group.
ALL_RANKS = [(opt, branch, stage) for opt in OPTIMIZERS for branch in ("never", "odd_steps") for stage in STAGES]
# Used on rank 0 only; at ZeRO-3 the branch stays out of units= (the root unit holds it).
RANK0_UNITS = ["emb", "trunk", "head"]


# A branch used with an exactly zero gradient (added times 0.0): on every rank, or on
# rank 0 only. Used, so stepped: AdamW's weight decay moves it, as in torch.
ZERO_GRAD = [(branch, stage) for branch in (None, "rank0") for stage in STAGES]
# Exchanges of used-parameter flags in 3 steps: stage 0 reads the reduced gradient and
# exchanges only when some parameter's reduced gradient is all zeros; stages 1-3 always.
EXCHANGES = [("branchy", None, 0, 0), ("branchy", "never", 0, 3), ("branchy", "rank0", 0, 0),
             ("branch_times_zero", None, 0, 3), ("branchy", None, 1, 3), ("branchy", None, 3, 3)]


@functools.cache
def reference(opt: str, branch: str, kind: str = "branchy") -> dict:
    return user_model_jobs.train(kind, None, steps=4, branch=branch, **OPTIMIZERS[opt])


@functools.cache
def runs(world_size: int, checkpoint_dir: str) -> tuple:
    cases = [dict(kind="branchy", stage=stage, steps=4, branch=branch, **OPTIMIZERS[opt])
             for opt, branch, stage in ALL_RANKS]
    cases += [dict(kind="branchy", stage=stage, branch="rank0", units=RANK0_UNITS if stage == 3 else None,
                   **OPTIMIZERS["sgd"]) for stage in STAGES]
    cases += [dict(kind="branchy", stage=stage, steps=4, branch="odd_steps", resume_at=3,
                   checkpoint_dir=f"{checkpoint_dir}/ws{world_size}/stage{stage}", **OPTIMIZERS["adam"])
              for stage in STAGES]
    cases += [dict(kind="branch_times_zero", stage=stage, steps=4, branch=branch,
                   units=RANK0_UNITS if stage == 3 and branch else None, **OPTIMIZERS["adamw"])
              for branch, stage in ZERO_GRAD]
    cases += [dict(kind="branch_times_zero", ddp=True, steps=4, branch="rank0", **OPTIMIZERS["adamw"])]
    cases += [dict(count=True, kind=kind, branch=branch, stage=stage) for kind, branch, stage, _ in EXCHANGES]
    cases += [dict(kind="branchy", ddp=True, branch="rank0", **OPTIMIZERS["sgd"])]
    out = on_ranks(user_model_jobs.many, world_size, cases)[0]
    n, s, z, e = len(ALL_RANKS), len(STAGES), len(ZERO_GRAD), len(EXCHANGES)
    zero_grad = out[n + 2 * s:n + 2 * s + z + 1]
    exchanges = out[n + 2 * s + z + 1:n + 2 * s + z + 1 + e]
    return out[:n], out[n:n + s], out[-1], out[n + s:n + 2 * s], zero_grad, exchanges


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("resume"))


def test_a_parameter_no_rank_used_is_not_updated_as_in_torch_optim(checkpoints):
    for (opt, branch, stage), run in zip(ALL_RANKS, runs(2, checkpoints)[0], strict=True):
        where = f"{opt}, branch {branch}, stage {stage}"
        assert not isinstance(run, str), f"{where}: {run}"
        ref = reference(opt, branch)
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6), where
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-6, where
        if branch == "never":  # not moved at all, not merely little
            initial = user_model_jobs.build("branchy").branch.weight
            assert torch.equal(run["params"]["branch.weight"], initial.detach()), where


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_used_on_some_ranks_is_averaged_with_zeros_as_ddp_does(world_size, checkpoints):
    _, rank0, ddp, *_ = runs(world_size, checkpoints)
    for stage, run in zip(STAGES, rank0, strict=True):
        assert not isinstance(run, str), f"stage {stage}: {run}"
        assert run["losses"] == pytest.approx(ddp["losses"], rel=1e-6), f"stage {stage}"
        assert user_model_jobs.rel_error(run["params"], ddp["params"]) < 1e-6, f"stage {stage}"


def test_a_parameter_used_with_a_zero_gradient_is_stepped_as_in_torch(checkpoints):
    # Its reduced gradient is all zeros, so stage 0 cannot read from it whether some rank
    # used it and exchanges flags: the branch is stepped (weight decay), never skipped.
    *_, zero_grad, _ = runs(2, checkpoints)
    initial = user_model_jobs.build("branch_times_zero").branch.weight.detach()
    for (branch, stage), run in zip(ZERO_GRAD, zero_grad[:-1], strict=True):  # [-1]: DDP's run, the reference
        where = f"branch {branch}, stage {stage}"
        assert not isinstance(run, str), f"{where}: {run}"
        ref = reference("adamw", None, "branch_times_zero") if branch is None else zero_grad[-1]
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6), where
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-6, where
        assert torch.allclose(run["params"]["branch.weight"], initial * (1 - 0.05 * 0.1) ** 4), where


def test_stage_0_exchanges_used_flags_only_when_a_reduced_gradient_is_all_zeros(checkpoints):
    *_, exchanges = runs(2, checkpoints)
    assert exchanges == [expected for *_, expected in EXCHANGES]


def test_a_resumed_run_keeps_the_steps_each_parameter_sat_out(checkpoints):
    # The branch sat out steps 0 and 2: at step 3 Adam's bias correction counts 2 steps
    # for it and 4 for the rest of its flat group. Saved after step 2, loaded into a new
    # engine, the run must end where the uninterrupted reference does.
    ref = reference("adam", "odd_steps")
    for stage, run in zip(STAGES, runs(2, checkpoints)[3], strict=True):
        assert not isinstance(run, str), f"stage {stage}: {run}"
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6), f"stage {stage}"
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-6, f"stage {stage}"
