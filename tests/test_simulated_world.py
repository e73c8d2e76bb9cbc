"""--simulate-world-size: rank 0 of N ranks in one process, bytes measured (Table 1's trend)."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from zerolearn.config import TrainConfig
from zerolearn.memory import model as analytic

pytestmark = pytest.mark.slow  # simulated worlds in fresh processes

NDS = (1, 8, 64, 1024)


def simulate(stage: int, nd: int, tmp_path) -> dict:
    out = tmp_path / f"s{stage}-{nd}.json"
    # One flat group (large bucket) keeps padding under Nd elements.
    args = TrainConfig(stage=stage, simulate_world_size=nd, steps=1, global_batch_size=1024, seq_len=8, d_model=32,
                       n_head=2, bucket_mb=64, dtype="bf16", quiet=True, report=str(out)).to_argv()
    done = subprocess.run([sys.executable, "-m", "zerolearn.train", *args], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def simulations(tmp_path_factory) -> dict:
    """Every (stage, Nd) run, each its own process, two at a time: most of a run is one
    process importing torch, which keeps one core busy. Each test reads its stage's runs."""
    d = tmp_path_factory.mktemp("simulated")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {(stage, nd): pool.submit(simulate, stage, nd, d) for stage in range(4) for nd in NDS}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_simulated_bytes_per_rank_follow_table1_trend(stage, simulations):
    measured = []
    for nd in NDS:
        report = simulations[(stage, nd)].result()
        assert report["world_size"] == nd and report["simulated"] is True
        assert [r["rank"] for r in report["ranks"]] == [0]
        entry = report["ranks"][0]
        psi = report["num_params"] + entry["padding_elements"]
        expected = analytic.model_state_bytes(psi, nd, stage, k=12, param_bytes=2, grad_bytes=2)
        for c in ("params", "grads", "optimizer_states"):
            assert entry["model_state_bytes"][c] == expected[c], (nd, c)
        measured.append(sum(entry["model_state_bytes"].values()))
    if stage == 0:
        assert len(set(measured)) == 1  # DP: Nd does not help
    else:
        assert measured == sorted(measured, reverse=True) and measured[-1] < measured[0]


def test_simulation_refuses_torchrun_and_bad_sizes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zerolearn.train", "--simulate-world-size", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--simulate-world-size 0: must be an integer >= 1" in done.stderr
