"""nano-ZeRO (zerolearn/nano.py): one short file made of the exercises, that trains as one
process, holds Fig 1's bytes and moves 2 / 2 / 2 / 3 Psi per step (Sec 5, Sec 7.2)."""

import ast
import functools
from pathlib import Path

import nano_jobs
import pytest
import torch

from jobs import on_ranks
from zerolearn.errors import ConfigError
from zerolearn.memory import model as analytic
from zerolearn.models import build_model
from zerolearn.nano import NanoZero

pytestmark = pytest.mark.quick

NANO = Path(__file__).resolve().parents[1] / "zerolearn" / "nano.py"
RUNS = [dict(stage=s, model=m) for m in ("mlp", "gpt") for s in (0, 1, 2, 3)] + \
    [dict(stage=3, model="mlp", prefetch=True), dict(stage=1, model="gpt", dtype="bf16")]


@functools.cache
def results(world_size: int) -> list[dict]:
    return on_ranks(nano_jobs.many, world_size, RUNS)[0]


def run_of(world_size: int, **kw) -> dict:
    return results(world_size)[RUNS.index(kw)]


def test_nano_is_one_file_of_at_most_300_lines_without_offload_zeropp_or_guards():
    source = NANO.read_text()
    assert len(source.splitlines()) <= 300
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    forbidden = ("zerolearn.engines", "zerolearn.zeropp", "zerolearn.guard")
    assert not [m for m in imported if m and m.startswith(forbidden)], imported


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage,prefetch", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_nano_trains_as_one_process(world_size, stage, prefetch):
    ref = nano_jobs.reference("mlp")
    run = run_of(world_size, stage=stage, model="mlp", **({"prefetch": True} if prefetch else {}))
    diff = torch.cat([(run["params"][n] - ref["params"][n]).flatten() for n in ref["params"]])
    norm = torch.cat([p.flatten() for p in ref["params"].values()]).norm()
    assert (diff.norm() / norm).item() <= 1e-6
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nano_gpt_losses_equal_one_process(world_size, stage):
    ref = nano_jobs.reference("gpt")
    assert run_of(world_size, stage=stage, model="gpt")["losses"] == pytest.approx(ref["losses"], rel=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nano_holds_fig1_bytes_and_moves_two_or_three_psi(world_size, stage):
    run = run_of(world_size, stage=stage, model="gpt")
    n = run["psi"] + run["padding"]
    formula = analytic.model_state_bytes(n, world_size, stage, k=12, param_bytes=4, grad_bytes=4)
    assert run["bytes"] == {c: formula[c] for c in ("params", "grads", "optimizer_states")}
    assert run["padding"] < world_size * (1 if stage < 3 else len(build_model("gpt", 0, gpt=nano_jobs.GPT).units()))
    assert run["moved"] == (3 if stage == 3 else 2) * n


@pytest.mark.parametrize("world_size", [2, 3])
def test_nano_bf16_keeps_an_fp32_master_k_12(world_size):
    run = run_of(world_size, stage=1, model="gpt", dtype="bf16")
    n = run["psi"] + run["padding"]
    formula = analytic.model_state_bytes(n, world_size, 1, k=12, param_bytes=2, grad_bytes=2)
    assert run["bytes"] == {c: formula[c] for c in ("params", "grads", "optimizer_states")}
    assert run["moved"] == 2 * n
    ref = nano_jobs.reference("gpt")
    assert run["losses"] == pytest.approx(ref["losses"], rel=2e-2)  # bf16 forward: about 3 digits


@pytest.mark.parametrize("kw,named", [(dict(stage=4), "stage=4"), (dict(stage=2, dtype="bf16"), "'bf16'"),
                                      (dict(stage=1, parts={"zero2_step": print}), "'zero2_step'")])
def test_nano_names_the_bad_option(kw, named):
    with pytest.raises(ConfigError, match=named):
        NanoZero(build_model("mlp", 0, mlp_width=8, mlp_layers=2), lr=1e-3, **kw)
