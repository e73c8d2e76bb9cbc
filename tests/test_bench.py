"""The benchmark against torch's and DeepSpeed's ZeRO: same training, bytes as the paper says, a right table."""

import json
from pathlib import Path

import pytest
import torch

from zerolearn.bench import harness, results, spec
from zerolearn.bench.__main__ import main
from zerolearn.bench.results import add_ratios, format_table, table_rows
from zerolearn.bench.spec import BenchSpec, parse_systems
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.quick

STORED = Path(__file__).resolve().parent.parent / "notebooks" / "data" / "bench"
TINY = BenchSpec(world_size=2, rounds=1, warmup=1, steps=2, d_model=32, n_layer=1, seq_len=16, global_batch_size=4,
                 timeout=240.0, systems=spec.ZEROLEARN + spec.TORCH)
DEEPSPEED = spec.deepspeed_installed()


@pytest.fixture(scope="module")
def tiny():
    return harness.run_bench(TINY, progress=False)


@pytest.mark.slow
def test_every_system_trains_the_same_losses(tiny):
    assert tiny["loss_reference"] == "zerolearn-0"
    for name, s in tiny["systems"].items():
        assert "error" not in s, name
        assert s["losses_equal"], (name, s["loss_max_abs_diff"])
        assert len(s["losses"]) == TINY.warmup + TINY.steps and len(s["step_seconds"]) == TINY.steps


@pytest.mark.slow
def test_zerolearn_stages_hold_the_papers_bytes_per_rank(tiny):
    # Every tensor of this GPT has an even number of elements: no padding at Nd = 2.
    for stage in range(4):
        expected = results.formula_bytes(tiny["psi"], 2, stage)
        ranks = tiny["systems"][f"zerolearn-{stage}"]["ranks"]
        assert len(ranks) == 2, stage
        for rank in ranks:
            assert rank["bytes"] == expected, (stage, rank["rank"])
            assert rank["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_fsdp2_keeps_one_nd_th_of_every_state_and_zero_optim_shards_only_adam(tiny):
    psi = tiny["psi"]
    for name in ("fsdp2-reshard", "fsdp2-no-reshard"):
        for rank in tiny["systems"][name]["ranks"]:
            assert rank["bytes"] == {"params": 4 * psi // 2, "grads": 4 * psi // 2, "optimizer_states": 8 * psi // 2}
    zero = tiny["systems"]["ddp-zero-optim"]["ranks"]
    assert all(r["bytes"]["params"] == r["bytes"]["grads"] == 4 * psi for r in zero)
    # Whole tensors per rank: the two shards of Adam's state add up to all of it, unequally.
    assert sum(r["bytes"]["optimizer_states"] for r in zero) == 8 * psi


@pytest.mark.slow
def test_the_stored_json_prints_the_same_table(tiny, tmp_path):
    path = tmp_path / "bench.json"
    from zerolearn.bench.results import write_json

    write_json(tiny, str(path))
    stored = json.loads(path.read_text())
    assert format_table(stored) == format_table(tiny)
    row = next(r for r in table_rows(stored) if r[0] == "zerolearn-2")
    s = stored["systems"]["zerolearn-2"]
    assert row[2] == f"{s['median_s'] * 1e3:.3g}" and row[5].endswith(s["best_peer"])
    assert row[7:10] == [max(r["bytes"][c] for r in s["ranks"]) for c in results.CATEGORIES]


def _constructed() -> dict:
    def entry(median):
        return {"median_s": median}

    return {"zerolearn-0": entry(0.3), "ddp": entry(0.2), "deepspeed-0": entry(0.1),
            "zerolearn-1": entry(0.2), "ddp-zero-optim": entry(0.4), "zerolearn-2": entry(0.5)}


def test_ratio_is_to_the_fastest_peer_of_the_same_stage():
    systems = _constructed()
    add_ratios(systems)
    assert systems["zerolearn-0"]["best_peer"] == "deepspeed-0"
    assert systems["zerolearn-0"]["ratio_to_best_peer"] == pytest.approx(3.0)
    assert systems["zerolearn-1"]["ratio_to_best_peer"] == pytest.approx(0.5)
    assert systems["zerolearn-2"]["ratio_to_best_peer"] is None  # no stage-2 peer ran
    assert "ratio_to_best_peer" not in systems["ddp"]


def test_ratio_column_prints_the_ratio_and_the_peer():
    systems = _constructed()
    add_ratios(systems)
    for s in systems.values():
        s.update(stage=0, q1_s=0.1, q3_s=0.2, min_s=0.1, max_s=0.5, losses_equal=True, loss_max_abs_diff=0.0,
                 ranks=[{"bytes": dict.fromkeys(results.CATEGORIES, 8), "peak_rss_bytes": 2**20,
                         "peak_rss_above_start_bytes": None, "cuda_peak_bytes": None}])
    rows = {r[0]: r for r in table_rows({"device": "cpu", "systems": systems})}
    assert rows["zerolearn-0"][5] == "3.00x deepspeed-0" and rows["zerolearn-2"][5] == "-"
    assert rows["zerolearn-0"][2] == "300" and rows["zerolearn-0"][11] == "-"


def test_losses_that_differ_are_flagged():
    systems = {"zerolearn-0": {"losses": [5.0, 4.0], "loss_round_spread": 0.0},
               "ddp": {"losses": [5.0, 4.001], "loss_round_spread": 0.0}}
    assert results.compare_losses(systems) == "zerolearn-0"
    assert systems["zerolearn-0"]["losses_equal"] and not systems["ddp"]["losses_equal"]


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "0"], "--world-size 0: must be an integer >= 1"),
    (["--steps", "-1"], "--steps -1: must be an integer >= 1"),
    (["--warmup", "0"], "--warmup 0: must be an integer >= 1"),
    (["--systems", "ddp,nope"], "--systems 'nope': allowed are"),
    (["--world-size", "3"], "--global-batch-size 16 is not divisible by world size 3"),
    (["--width", "66"], "--d-model 66 is not divisible by --n-head 4"),
    (["--batch", "10"], "--global-batch-size 10 is not divisible by world size 4"),
    (["--device", "tpu"], "--device 'tpu': allowed are cpu, cuda"),
    (["--out", "/nonexistent/x.json"], "--out /nonexistent/x.json: cannot write"),
    (["scaling", "--widths", "64,x"], "--widths 64,x: must be comma-separated integers"),
    (["scaling", "--world-sizes", "1,3"], "not divisible by world size 3"),
])
def test_bad_flags_are_refused_before_any_rank_starts(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(harness, "run_round", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_says_so(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--device", "cuda"])
    assert info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_default_systems_leave_deepspeed_out_when_it_is_missing(monkeypatch):
    monkeypatch.setattr(spec, "deepspeed_installed", lambda: False)
    assert parse_systems(None) == spec.ZEROLEARN + spec.TORCH
    with pytest.raises(ConfigError, match="DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"):
        parse_systems("zerolearn,deepspeed-2")
    assert parse_systems("torch,zerolearn-3") == ("zerolearn-3", *spec.TORCH)


def test_rounds_rotate_and_quartiles_are_inclusive():
    assert harness.rotate(["a", "b", "c"], 4) == ["b", "c", "a"]
    stats = results.step_stats([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (stats["median_s"], stats["q1_s"], stats["q3_s"]) == (3.0, 2.0, 4.0)
    assert results.step_stats([2.0])["q3_s"] == 2.0
    assert harness.peak_rss_bytes() > 0


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="deepspeed is not installed (make bench installs it)")
def test_deepspeed_trains_the_same_losses_and_shards_like_zero():
    result = harness.run_bench(TINY.replace(systems=("zerolearn-1", "deepspeed-1", "deepspeed-3")), progress=False)
    psi = result["psi"]
    for name in ("deepspeed-1", "deepspeed-3"):
        assert result["systems"][name]["losses_equal"], name
    stage3 = result["systems"]["deepspeed-3"]["ranks"][0]["bytes"]
    assert stage3["params"] == 4 * psi // 2  # its partition (ds_tensor)


def test_scaling_figure_draws_the_stored_result():
    from zerolearn.figures.bench import scaling_figure, scaling_series

    path = STORED / "scaling.json"
    fig = scaling_figure(path)
    assert len(fig.axes) == 6 and all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)
    world = scaling_series(path, "world")
    assert world["zerolearn-3"]["x"] == [1, 2, 4]
    psi = scaling_series(path, "psi")["zerolearn-0"]["x"]
    assert len(psi) >= 4 and psi[-1] >= 10 * psi[0]


def test_stored_scaling_measures_what_the_paper_expects():
    stored = json.loads((STORED / "scaling.json").read_text())
    points = stored["points"]
    assert len(points) >= 4
    for point in points:
        ours = {name: s for name, s in point["systems"].items() if name.startswith("zerolearn")}
        assert sorted(ours) == [f"zerolearn-{stage}" for stage in range(4)], (point["world_size"], point["d_model"])
        for s in ours.values():
            # d_model a multiple of 64: every tensor divides into Nd <= 4 shards, no padding.
            assert s["bytes"] == [s["expected_bytes"]] * point["world_size"], (point["world_size"], point["d_model"])
            assert s["comm_elements_per_step"] == s["expected_comm_elements_per_step"]


def test_the_summary_keeps_the_full_tables_cells():
    stored = json.loads((STORED / "quick.json").read_text())
    full = {r[0]: r for r in table_rows(stored)}
    s = results.summary(stored)
    assert [r[0] for r in s["rows"]] == list(full)
    for row in s["rows"]:
        f = full[row[0]]
        assert len(row) == len(results.SUMMARY_HEADER)
        assert row[:4] == f[:4] and row[4:6] == f[5:7] and row[6] == f[10]  # peak RSS on the CPU
    assert s["job"] == format_table(stored).split("\n", 1)[0]
    assert results.summary(s) is s  # a summary stays one
    printed = results.format_summary(stored)
    assert "peak RSS" in printed and "on the CPU" in printed


def test_the_stored_gpu_measurement_names_its_machine_and_beats_no_peer_by_fiat():
    gpu = json.loads((STORED / "gpu.json").read_text())
    printed = results.format_summary(gpu)
    assert gpu["device"] == "cuda" and gpu["accelerator"]["name"] in printed and "CUDA peak" in printed
    assert gpu["measured"] and gpu["measured"] in printed
    rows = {r[0]: r for r in results.summary(gpu)["rows"]}
    for stage in range(4):
        ours = rows[f"zerolearn-{stage}"]
        ratio, peer = ours[4].split("x ")
        # the ratio column is the medians' quotient, to the 3 digits stored
        assert float(ratio) == pytest.approx(float(ours[2]) / float(rows[peer][2]), abs=0.006)
        assert rows[peer][1] == stage
