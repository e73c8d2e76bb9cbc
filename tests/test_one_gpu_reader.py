"""The machine decides what teaches: one GPU gets gloo ranks for the tour, a simulated world
for the seed experiment; FSDP2 meshes live on the ranks' device. CUDA is faked here
(``torch.cuda.is_available`` / ``device_count``), so these run on any machine."""

from __future__ import annotations

import argparse
import ast
import json
import pathlib

import pytest
import torch

from zerolearn.errors import ConfigError
from zerolearn.experiments import machine, seed_experiment

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def gpus(monkeypatch):
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return fake


def test_one_gpu_tours_on_four_gloo_ranks_and_says_why(gpus):
    gpus(1)
    plan = machine.plan_tour()
    assert (plan.world_size, plan.backend, plan.device, plan.simulated) == (4, "gloo", "cpu", False)
    assert "1 GPU here, fewer than the 4 ranks" in plan.note and "--backend nccl --world-size 1" in plan.note
    assert "\n" not in plan.note
    one = machine.plan_tour(1, "nccl")  # NCCL at world size 1 stays available
    assert (one.world_size, one.backend, one.device) == (1, "nccl", "cuda")


def test_the_tour_uses_every_gpu_when_there_are_two_or_more(gpus):
    gpus(8)
    assert (machine.plan_tour().world_size, machine.plan_tour().backend) == (8, "nccl")
    assert machine.plan_tour(4).backend == "nccl"
    assert machine.plan_tour(16).backend == "gloo"  # more ranks than GPUs
    gpus(0)
    plan = machine.plan_tour()
    assert (plan.world_size, plan.backend) == (4, "gloo") and "no GPU here" in plan.note
    with pytest.raises(ConfigError, match="--backend nccl: CUDA is not available"):
        machine.plan_tour(backend="nccl")
    with pytest.raises(ConfigError, match="--world-size 0"):
        machine.plan_tour(0)


def test_the_tour_prints_its_plan_in_one_line_before_training(gpus, monkeypatch, capsys):
    from zerolearn import tour

    gpus(1)
    ran = {}

    def fake_run(world_size, steps, backend, config):
        ran.update(world_size=world_size, backend=backend)
        raise SystemExit(0)

    monkeypatch.setattr(tour, "run_tour", fake_run)
    with pytest.raises(SystemExit):
        tour.main(["--steps", "1"])
    assert ran == {"world_size": 4, "backend": "gloo"}
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("tour: 4 gloo ranks on the CPU: 1 GPU here")


def test_the_seed_experiment_simulates_its_ranks_on_one_gpu(gpus):
    gpus(1)
    plan = machine.plan_seed()
    assert (plan.world_size, plan.backend, plan.device, plan.simulated) == (2, "fake", "cuda", True)
    assert "2 simulated ranks on the GPU" in plan.note
    assert machine.plan_seed(simulate_world_size=8).world_size == 8
    gpus(2)
    assert machine.plan_seed().backend == "nccl"
    gpus(0)
    assert (machine.plan_seed().backend, machine.plan_seed().device) == ("gloo", "cpu")
    assert machine.plan_seed(simulate_world_size=2).device == "cpu"


def test_the_seed_experiment_runs_each_simulated_stage_in_a_fresh_process_unless_asked(gpus, monkeypatch):
    gpus(1)
    calls = []
    monkeypatch.setattr(seed_experiment, "in_fresh_process", lambda c: calls.append(("fresh", c)) or {})
    monkeypatch.setattr(seed_experiment, "train_here", lambda c: calls.append(("here", c)) or {})
    ns = argparse.Namespace(width=64, layers=2, batch=4, steps=1, dtype="fp32", bucket_mb=1.0, world_size=None,
                            simulate_world_size=None, one_process=False)
    seed_experiment.run_all(ns)
    assert [(how, c.stage, c.simulate_world_size, c.device) for how, c in calls] == [
        ("fresh", s, 2, "cuda") for s in range(4)]
    calls.clear()
    ns.one_process = True
    seed_experiment.run_all(ns)
    assert [how for how, _ in calls] == ["here"] * 4


def test_chapter_scripts_fall_back_to_gloo_with_fewer_gpus_than_ranks(gpus):
    gpus(1)
    backend, device, note = machine.plan_chapter(2)
    assert (backend, device) == ("gloo", "cpu") and "2 ranks, 1 GPU(s)" in note
    assert machine.plan_chapter(1) == ("auto", "auto", None)
    assert machine.plan_chapter(2, "nccl", "cuda") == ("nccl", "cuda", None)  # asked for: refused later, by name


def test_every_fsdp2_use_builds_its_mesh_on_the_ranks_device():
    # fully_shard without a mesh builds one on CUDA whenever CUDA is present, also on gloo ranks.
    calls = []
    for folder in ("zerolearn", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fully_shard":
                    calls.append((path.name, node.lineno, {k.arg for k in node.keywords}))
    assert len(calls) >= 6
    assert all("mesh" in keywords for *_, keywords in calls), [c for c in calls if "mesh" not in c[2]]


def test_the_stored_gpu_seed_experiment_reads_beside_the_blog():
    rows = seed_experiment.gpu_table()
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert [r["peak_MiB"] for r in rows] == [9616.8, 7704.5, 6939.4, 6178.0]
    assert [r["blog_peak_MB"] for r in rows] == [11529, 8090, 8470, 5034]
    assert rows[2]["peak_MiB"] < rows[1]["peak_MiB"]  # Sec 5.2, where the blog found the opposite
    assert rows[0]["device"] == "NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9"


def test_gpu_table_names_a_file_that_is_not_a_measurement(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"device": {}}))
    with pytest.raises(ValueError, match="no 'stages'"):
        seed_experiment.gpu_table(bad)
