"""make gpu-check, planned and tried on the CPU: its checks, their time budget, its command
line without CUDA, and the checks that can run small on gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from zerolearn import gpu_check
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.quick


def test_the_plan_covers_every_check_within_six_minutes_on_one_gpu():
    names = [c.name for c in gpu_check.plan(1)]
    assert names == ["stages-fp32", "stages-bf16", "stages-fp16", "seed-2", "seed-8", "zero-r", "offload", "zeropp",
                     "checkpoint", "chapter-scripts", "bench-1024", "md"]
    assert sum(c.seconds for c in gpu_check.plan(1)) <= gpu_check.BUDGET_S == 360
    assert [c.name for c in gpu_check.plan(8)][-2:] == ["tour-all-gpus", "stage3-all-gpus"]
    with pytest.raises(ConfigError, match="gpus=-1"):
        gpu_check.plan(-1)


def test_dry_run_prints_the_plan_without_a_gpu(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "seed-8" in out and "ZeRO-2 below ZeRO-1" in out and out.strip().splitlines()[-1].startswith("total ~")


def test_without_cuda_it_refuses_and_names_a_bad_check(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_check.main([])
    assert e.value.code == 2 and "CUDA is not available" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--only", "stages-fp32,warp"])
    assert e.value.code == 2 and "--only warp: allowed are" in capsys.readouterr().err


@pytest.mark.slow
def test_the_small_checks_pass_on_gloo_ranks_on_the_cpu(tmp_path):
    checks = [c for c in gpu_check.plan(1) if c.name in ("stages-fp32", "zero-r", "offload", "zeropp", "checkpoint")]
    summary = gpu_check.run_checks(checks, gpu_check.TINY, tmp_path)
    assert summary["failed"] == [], [c["error"] for c in summary["checks"]]
    assert summary["torch"] == torch.__version__ and "device" in summary and "nccl" in summary
    rows = json.loads((tmp_path / "stages-fp32.json").read_text())["rows"]
    assert [r["psi_per_step"] for r in rows] == [2.0, 2.0, 2.0, 3.0]
    assert (tmp_path / "summary.txt").read_text().startswith("device: ")


def test_a_wrong_number_fails_the_check_by_name(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.LOSS_TOL, "fp32", -1.0)  # nothing can be this close
    check = [c for c in gpu_check.plan(1) if c.name == "zero-r"]
    summary = gpu_check.run_checks(check, gpu_check.TINY, tmp_path)
    assert summary["failed"] == ["zero-r"] and "zero-r: losses differ" in summary["checks"][0]["error"]


@pytest.mark.slow
def test_the_seed_checks_pass_small_on_the_cpu(tmp_path):
    checks = [c for c in gpu_check.plan(1) if c.name == "seed-2"]
    summary = gpu_check.run_checks(checks, gpu_check.TINY, tmp_path)
    assert summary["failed"] == [], [c["error"] for c in summary["checks"]]
