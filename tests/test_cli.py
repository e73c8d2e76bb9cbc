"""The train CLI: the report contract of docs/ARCHITECTURE.md ("The training run"), and bad input refused (exit 2)."""

import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import jobs
from jobs import on_ranks
from zerolearn.config import TrainConfig
from zerolearn.dist import ConfigError, launch
from zerolearn.engines import make_engine

pytestmark = pytest.mark.slow  # the CLI trained at world sizes 1-4

RUN = TrainConfig(steps=2, global_batch_size=12, seq_len=16, d_model=32, n_head=2, bucket_mb=0.01, quiet=True)
ARGV = RUN.to_argv()  # the same run on the command line
OPS = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}


@functools.cache
def reports(world_size: int) -> list[dict]:
    return on_ranks(jobs.train_all_stages, world_size, RUN)[0]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerolearn.train", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_report_contract_holds_for_every_stage(world_size):
    per_stage = reports(world_size)
    assert len(per_stage) == 4
    for stage, report in enumerate(per_stage):
        assert report["config"]["stage"] == stage and report["world_size"] == world_size
        assert report["backend"] == "gloo" and report["device"] == "cpu"
        assert report["torch"] == torch.__version__.split("+")[0]
        assert len(report["losses"]) == 2 and report["first_step"] == 0
        assert [r["rank"] for r in report["ranks"]] == list(range(world_size))
        for entry in report["ranks"]:
            assert set(entry["model_state_bytes"]) == {"params", "grads", "optimizer_states"}
            assert set(entry["comm"]) == OPS
            assert all(set(v) == {"calls", "elements", "bytes"} for v in entry["comm"].values())
            # CPU: the ledger's peak over the last step, model states plus residual states.
            held = sum(entry["model_state_bytes"].values())
            assert entry["peak_bytes"] >= held - entry["model_state_bytes"]["grads"]
            assert entry["peak_bytes"] == entry["memory"]["peak_bytes"]
            assert entry["memory"]["peak_by_category"]["activations"] > 0
        analytic = report["analytic"]["model_state_bytes"]
        measured = report["ranks"][0]["model_state_bytes"]
        pad = report["ranks"][0]["padding_elements"]
        for category in measured:  # equal up to padding (at most 16 bytes per padded element)
            assert 0 <= measured[category] - analytic[category] <= 16 * pad
        assert report["step_seconds_median"] > 0


def test_losses_agree_across_stages_and_world_sizes():
    base = reports(1)[0]["losses"]
    for world_size in (1, 2, 3, 4):
        per_stage = reports(world_size)
        assert len(per_stage) == 4, world_size
        for report in per_stage:
            assert report["losses"] == pytest.approx(base, rel=1e-5)


def test_cli_writes_the_report(tmp_path):
    out = tmp_path / "run.json"
    done = cli("--stage", "3", "--report", str(out), *ARGV)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["world_size"] == 1 and report["config"]["stage"] == 3
    assert "stage 3: loss" in done.stdout


BAD_INPUT = [
    (["--stage", "4"], {}, "argument --stage: invalid choice: 4"),
    (["--global-batch-size", "10", "--grad-accum-steps", "3"], {},
     "--global-batch-size 10 is not divisible by world size 1 x --grad-accum-steps 3"),
    (["--dtype", "fp8"], {}, "argument --dtype: invalid choice: 'fp8'"),
    (["--model", "resnet"], {}, "argument --model: invalid choice: 'resnet'"),
    (["--steps", "0"], {}, "--steps 0: must be an integer >= 1"),
    (["--timeout", "-5"], {}, "--timeout -5.0: must be a finite number > 0"),
    (["--timeout", "nan"], {}, "--timeout nan: must be a finite number > 0"),
    (["--timeout", "0"], {}, "--timeout 0.0: must be a finite number > 0"),
    (["--lr", "inf"], {}, "--lr inf: must be a finite number > 0"),
    (["--n-head", "0"], {}, "--n-head 0: must be an integer >= 1"),
    (["--n-layer", "-2"], {}, "--n-layer -2: must be an integer >= 1"),
    (["--d-model", "64", "--n-head", "5"], {}, "--d-model 64 is not divisible by --n-head 5"),
    (["--seq-len", "100000000"], {}, "--seq-len 100000000: longer than the training corpus"),
    (["--global-batch-size", "1000000000"], {}, "--global-batch-size 1000000000: one step needs at least"),
    (["--report", "/nonexistent/r.json"], {}, "--report /nonexistent/r.json: cannot write a file there"),
    (["--checkpoint-dir", f"{sys.executable}/ck"], {},
     f"--checkpoint-dir {sys.executable}/ck: cannot be reached (Not a directory"),
    (["--tensor-parallel", "2", "--checkpoint-dir", "ck"], {}, "--checkpoint-dir with --tensor-parallel 2"),
    (["--backend", "nccl"], {}, "--backend nccl: CUDA is not available"),
    (["--device", "cuda"], {}, "--device cuda: CUDA is not available"),
    ([], {"RANK": "0", "WORLD_SIZE": "2"}, "torchrun environment incomplete"),
    (["--cuda-memory-snapshot", "m.pickle", "--device", "cpu"], {},
     "--cuda-memory-snapshot m.pickle: needs a CUDA device; this run is on cpu"),
]


def bad_runs(cases: list[tuple[list[str], dict]], tmp_path) -> list[tuple[int, str]]:
    """``(exit code, stderr)`` of each command line of ``python -m zerolearn.train`` in
    ``cases``, all run by tests/cli_driver.py in one process (torch imported once)."""
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "cli_driver.py"), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = [tuple(r) for r in json.loads(done.stdout.splitlines()[-1])]
    assert len(out) == len(cases)
    return out


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> dict:
    """Every BAD_INPUT case, keyed by (args, env); each test reads its own."""
    cases = [(args, env) for args, env, _ in BAD_INPUT]
    out = bad_runs(cases, tmp_path_factory.mktemp("cli"))
    return {(tuple(args), tuple(env.items())): r for (args, env), r in zip(cases, out, strict=True)}


@pytest.mark.parametrize("args, env, message", BAD_INPUT)
def test_bad_input_exits_2_with_a_message_naming_it(args, env, message, bad_input_runs):
    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("CUDA is available here")
    code, stderr = bad_input_runs[(tuple(args), tuple(env.items()))]
    assert code == 2, stderr
    assert message in stderr and "Traceback" not in stderr


def test_bad_input_from_a_shell_exits_2_with_one_line():
    done = cli("--stage", "4")
    assert done.returncode == 2 and "argument --stage: invalid choice: 4" in done.stderr
    assert "Traceback" not in done.stderr


def test_global_batch_that_world_size_does_not_divide_is_refused_before_training():
    with pytest.raises(Exception, match="--global-batch-size 12 is not divisible by world size 5"):
        launch(jobs.train_all_stages, 5, RUN)


def test_model_on_several_devices_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigError, match=r"different devices \['cpu', 'meta'\]"):
        make_engine(0, model)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=7), "--stage 7: allowed are 0, 1, 2, 3"),
    (dict(stage=1, optimizer="lion"), "--optimizer 'lion': allowed are adam, adamw, sgd"),
    (dict(stage=1, dtype="int8"), "--dtype 'int8': allowed are fp32, bf16, fp16"),
    (dict(stage=2, lr=-1.0), "--lr -1.0: must be a finite number >= 0"),
])
def test_engine_refuses_bad_arguments_before_any_work(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make_engine(model=nn.Linear(2, 2), **kwargs)


def test_cuda_memory_snapshot_files_are_one_per_rank():
    from zerolearn.train import snapshot_path

    assert snapshot_path("run/mem.pickle", 0, 1) == "run/mem.pickle"
    assert [snapshot_path("run/mem.pickle", r, 2) for r in (0, 1)] == ["run/mem_rank0.pickle", "run/mem_rank1.pickle"]


def test_ranks_started_with_other_options_are_named_before_training():
    per_rank = {1: dict(seed=1), 2: dict(seed=1, lr=0.002)}
    messages = on_ranks(jobs.train_with_per_rank_options, 3, RUN, per_rank)
    assert len(messages) == 3
    for message in messages:  # every rank refuses alike, so none waits on a collective
        assert message.startswith("ConfigError: ranks were started with different configurations"), message
        assert "--seed: rank 0 has 0; ranks 1, 2 have 1" in message
        assert "--lr: ranks 0, 1 have 0.001; rank 2 has 0.002" in message


def test_a_checkpoint_dir_that_ranks_do_not_share_is_refused(tmp_path):
    # Two ranks on one machine, each pointed at its own folder: as two nodes without a
    # shared filesystem would be. (The folder is an option, so the configuration check
    # names it first; the marker check is what catches one path that means two places.)
    from zerolearn import agree

    messages = on_ranks(jobs.check_shared_marker, 2, str(tmp_path))
    for message in messages:  # every rank refuses alike
        assert message.startswith("ConfigError: --checkpoint-dir "), message
        assert "rank 1 does not see the files rank 0 writes there" in message
    version = agree.code_version()
    assert re.fullmatch(r"[0-9a-f]{12}", version), version  # SHA-256's first 12 hex digits
    assert agree.fingerprint({})["zerolearn source"] == version  # what the ranks compare
