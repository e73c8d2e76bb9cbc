"""The blog's MLP experiment on our engines: ZeRO-2's peak below ZeRO-1's (Sec 5.2)."""

import argparse

import pytest

from zerolearn.experiments import seed_experiment

pytestmark = pytest.mark.slow  # the blog's MLP at every stage on spawned ranks


def test_seed_experiment_puts_zero2_peak_below_zero1(capsys):
    argv = ["--width", "256", "--steps", "2", "--bucket-mb", "0.25"]
    assert seed_experiment.main(argv) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2's peak" in out and "is below ZeRO-1's" in out


def test_seed_experiment_model_states_match_the_formulas():
    ns = argparse.Namespace(width=128, layers=6, batch=16, steps=1, dtype="bf16", bucket_mb=0.05,
                            world_size=2, simulate_world_size=None)
    reports = seed_experiment.run_all(ns)
    assert [report["config"]["stage"] for report in reports] == [0, 1, 2, 3]
    for report in reports:
        entry, formula = report["ranks"][0], report["analytic"]["model_state_bytes"]
        pad = entry["padding_elements"]
        assert set(entry["model_state_bytes"]) == {"params", "grads", "optimizer_states"}
        for c, measured in entry["model_state_bytes"].items():
            assert 0 <= measured - formula[c] <= 16 * pad
