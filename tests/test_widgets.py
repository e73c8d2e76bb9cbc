"""The explorers show the paper's formulas, the measured ledger and the allocator simulator.

Each test moves every control of an explorer across its range and checks the numbers
the explorer then shows (``result`` and the HTML ``summary``) against
``zerolearn.memory``, the training report, or ``zerolearn.residual.defrag``. Expected
values are computed by those modules or by hand in the comments, never copied from
a run.
"""

import functools
import itertools

import pytest

from jobs import on_ranks
from zerolearn import figures, widgets
from zerolearn.chapters.ch04.lesson import all_stages
from zerolearn.config import TrainConfig
from zerolearn.errors import ConfigError
from zerolearn.figures import formulas
from zerolearn.memory.fit import ActivationSpec, per_device_bytes, smallest_fit
from zerolearn.memory.model import FIGURE1_GB, GB, V100_BYTES, comm_volume_elements, model_state_bytes, optimizer_k
from zerolearn.residual import defrag
from zerolearn.widgets.stage import CB_MB

pytestmark = pytest.mark.slow  # the explorers, some over recorded allocation traces

PSIS = [1e8, 1.5e9, 7.5e9, 1.28e11, 1e12]
MIB = 2**20


def shown(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.2f} GB"


def set_values(explorer, **values) -> None:
    with explorer.hold():  # one refresh for all of them
        for name, value in values.items():
            explorer.controls[name].value = value


def sweep(explorer, ranges: dict):
    """Move each control across its range in turn, the others left where they are (the
    numbers and summary follow every move; the figure is drawn once, at the end)."""
    with explorer.figure_deferred():
        for name, values in ranges.items():
            for value in values:
                explorer.controls[name].value = value
                yield name, value
    assert explorer.view.value[:4] == b"\x89PNG"


def test_gpu_table_uses_the_papers_decimal_gb():
    assert figures.GPUS["V100 32 GB"] == V100_BYTES == 32 * 10**9
    assert figures.GPUS["A100 80 GB"] == figures.GPUS["H100 80 GB"] == 80 * 10**9
    assert figures.GPUS["H200 141 GB"] == 141 * 10**9


def test_memory_explorer_default_is_figure_1():
    explorer = widgets.MemoryExplorer()
    # Psi = 7.5B, Nd = 64, K = 12: 120, 31.4, 16.6, 1.9 GB as printed in Fig 1.
    for stage, printed in FIGURE1_GB.items():
        assert explorer.result["stages"][stage]["total"] / GB == pytest.approx(printed, abs=0.05)
    assert explorer.result["fits"] and "fits" in explorer.summary.value
    assert explorer.view.value[:4] == b"\x89PNG"


def test_memory_explorer_follows_every_control():
    explorer = widgets.MemoryExplorer()
    ranges = {"psi": PSIS, "nd": figures.NDS, "stage": [0, 1, 2, 3], "optimizer": ["adam", "adamw", "sgd"],
              "dtype": ["bf16", "fp16", "fp32"]}
    for _ in sweep(explorer, ranges):
        psi, nd, stage, optimizer, dtype = (explorer.controls[n].value for n in ranges)
        expected = per_device_bytes(psi, nd, stage, optimizer=optimizer, dtype=dtype)
        assert explorer.result["stages"][stage] == expected and explorer.result["total"] == expected["total"]
        assert shown(expected["total"]) in explorer.summary.value
        assert f"K = {optimizer_k(optimizer, dtype)} bytes" in explorer.summary.value


def test_memory_explorer_says_whether_the_stage_fits_each_gpu():
    explorer = widgets.MemoryExplorer(psi=7.5e9, nd=8, stage=2)
    need = per_device_bytes(7.5e9, 8, 2)["total"]  # 15 + 105 / 8 = 28.1 GB
    verdicts = set()
    for gpu, device in figures.GPUS.items():
        explorer.controls["gpu"].value = gpu
        assert explorer.result["device_bytes"] == device
        assert explorer.result["fits"] == (need <= device)
        verdict = "<b>fits</b>" if need <= device else "<b>does not fit</b>"
        assert verdict in explorer.summary.value and shown(device) in explorer.summary.value
        verdicts.add(verdict)
    assert verdicts == {"<b>fits</b>", "<b>does not fit</b>"}  # 16 and 24 GB are too small, 32 GB is not


def test_memory_explorer_adds_activations_of_sec_3_2():
    explorer = widgets.MemoryExplorer(psi=1.5e9, nd=1, stage=0)
    set_values(explorer, activations=True, layers=48, hidden=1600, seq_len=1024, batch=32)
    # GPT-2 1.5B at batch 32: about 60 GB of activations in 2-byte values (Sec 3.2).
    assert explorer.result["stages"][0]["activations"] == pytest.approx(60e9, rel=0.01)
    ranges = {"layers": [1, 12, 96], "hidden": [64, 4096], "seq_len": [128, 2048], "batch": [1, 8],
              "checkpointing": [True, False]}
    for _ in sweep(explorer, ranges):
        layers, hidden, seq_len, batch, ckpt = (explorer.controls[n].value for n in ranges)
        spec = ActivationSpec(hidden=hidden, layers=layers, batch_per_gpu=batch, seq_len=seq_len, checkpointing=ckpt)
        expected = per_device_bytes(1.5e9, 1, 0, activation=spec)
        assert explorer.result["stages"][0] == expected
        assert shown(expected["activations"]) in explorer.summary.value
    explorer.controls["activations"].value = False
    assert explorer.result["stages"][0]["activations"] == 0


def test_fit_solver_7b_on_80gb_is_zero1_on_two_gpus():
    solver = widgets.FitSolver(psi=7e9, gpu="A100 80 GB")
    fit = solver.result["fit"]
    # Nd = 1: 16 x 7 = 112 GB > 80. Nd = 2: P_os holds 4 x 7 + 12 x 7 / 2 = 70 GB.
    assert (fit.stage, fit.gpus) == (1, 2) and fit.bytes_per_device == pytest.approx(70e9)
    assert "on 2 GPU(s)" in solver.summary.value and "70.00 GB" in solver.summary.value
    assert "87.5 % used" in solver.summary.value


def test_fit_solver_follows_every_control():
    solver = widgets.FitSolver()
    ranges = {"psi": PSIS, "gpu": list(figures.GPUS), "optimizer": ["adam", "adamw", "sgd"],
              "dtype": ["bf16", "fp16", "fp32"]}
    for _ in sweep(solver, ranges):
        psi, gpu, optimizer, dtype = (solver.controls[n].value for n in ranges)
        expected = smallest_fit(psi, figures.GPUS[gpu], optimizer=optimizer, dtype=dtype)
        assert solver.result["fit"] == expected
        if expected is None:
            assert "No stage fits" in solver.summary.value
        else:
            assert f"on {expected.gpus} GPU(s)" in solver.summary.value
            assert shown(expected.bytes_per_device) in solver.summary.value
            assert f"{100 * expected.utilization:.1f} % used" in solver.summary.value


@pytest.mark.parametrize("gpu", ["V100 16 GB", "A100 40 GB", "H200 141 GB"])
def test_fewest_gpus_per_stage_is_the_first_nd_that_fits(gpu):
    device = figures.GPUS[gpu]
    for psi, stage, dtype in itertools.product(PSIS, range(4), ["bf16", "fp32"]):
        gpus = figures.fewest_gpus(psi, device, stage, dtype=dtype)
        need = functools.partial(lambda nd, p, s, d: per_device_bytes(p, nd, s, dtype=d)["total"],
                                 p=psi, s=stage, d=dtype)
        if gpus is None:
            assert need(1024) > device
        else:
            assert need(gpus) <= device and (gpus == 1 or need(gpus - 1) > device)


def test_tradeoff_shows_memory_and_one_and_a_half_times_the_traffic():
    explorer = widgets.TradeOff()
    ranges = {"psi": PSIS, "nd": [1, 4, 64, 1024], "optimizer": ["sgd", "adam"], "dtype": ["fp32", "bf16"]}
    for _ in sweep(explorer, ranges):
        psi, nd, optimizer, dtype = (explorer.controls[n].value for n in ranges)
        width = 4 if dtype == "fp32" else 2
        for stage, row in explorer.result.items():
            assert row["bytes"] == per_device_bytes(psi, nd, stage, optimizer=optimizer, dtype=dtype)["total"]
            assert row["traffic_ratio"] == comm_volume_elements(psi, stage) / comm_volume_elements(psi, 0)
            assert row["traffic_bytes"] == comm_volume_elements(psi, stage) * width
            assert shown(row["bytes"]) in explorer.summary.value
        assert explorer.result[3]["traffic_ratio"] == 1.5  # 3 Psi over 2 Psi (Sec 7.2.2)


@functools.cache
def measured_reports() -> list[dict]:
    config = TrainConfig(model="mlp", mlp_width=64, mlp_layers=4, global_batch_size=4, steps=1, bucket_mb=0.01,
                         memory_timeline=True, prefetch_mb=0)  # ZeRO-3: one unit per prefetch
    return on_ranks(all_stages, 2, config)[0]


def test_timeline_viewer_shows_the_ledgers_numbers_per_stage():
    reports = measured_reports()
    viewer = widgets.TimelineViewer(reports)
    unit = 64 * 65 * 4  # one Linear(64, 64) with bias, fp32 bytes: ZeRO-3's unit here
    for report in reports:
        stage = report["config"]["stage"]
        viewer.controls["stage"].value = stage
        entry = report["ranks"][0]
        assert viewer.result["peak_bytes"] == entry["memory"]["peak_bytes"]
        assert f"{entry['memory']['peak_bytes'] / 1024:,.1f} KiB" in viewer.summary.value
        psi = report["num_params"] + entry["padding_elements"]
        params = model_state_bytes(psi, 2, stage, k=8, param_bytes=4, grad_bytes=4)["params"]
        assert viewer.result["params_min"] == params  # shards (stage 3) or the full replica
        if stage == 3:  # gathered and freed per unit: at most two units on top of the shards
            assert params < viewer.result["params_max"] <= params + 2 * unit
        else:
            assert viewer.result["params_max"] == params
    for chosen in [("params",), ("grads", "temporary"), tuple(figures.COLORS)]:
        viewer.controls["categories"].value = chosen
        assert viewer.view.value[:4] == b"\x89PNG"


@pytest.mark.slow  # figures.recorded_trace
def test_fragmentation_simulator_replays_through_defrag():
    sim = widgets.FragmentationSimulator()
    trace = figures.recorded_trace()
    capacity = sim.controls["capacity"]
    ranges = {"capacity": range(capacity.min, capacity.max + 1, 64), "md": [True, False], "scale": [0.5, 2.0]}
    smallest = functools.cache(lambda md, scale: defrag.smallest_capacity(trace, md=md, scale=scale))
    for _ in sweep(sim, ranges):
        cap, md, scale = (sim.controls[n].value for n in ranges)
        expected = defrag.replay(trace, cap * MIB, md=md, scale=scale)
        assert sim.result["ok"] == expected.ok and sim.result["failed_event"] == expected.failed_event
        assert sim.result["smallest_with_md"] == smallest(True, scale)
        assert sim.result["smallest_without_md"] == smallest(False, scale)
        assert ("<b>Fits</b>" if expected.ok else "<b>Out of memory</b>") in sim.summary.value


@pytest.mark.slow  # figures.recorded_trace
def test_fragmentation_default_fails_with_a_third_free_until_md_is_on():
    sim = widgets.FragmentationSimulator()
    assert sim.controls["capacity"].value == -(-defrag.smallest_capacity(figures.recorded_trace(), md=True) // MIB)
    assert not sim.result["ok"] and sim.result["free_fraction"] > 0.3  # Sec 6.3: OOM with over 30% free
    sim.controls["md"].value = True
    assert sim.result["ok"]


@pytest.mark.parametrize("make", [figures.memory_figure, figures.fit_figure, figures.tradeoff_figure,
                                  pytest.param(figures.fragmentation_figure, marks=pytest.mark.slow),  # recorded_trace
                                  lambda: figures.timeline_figure(measured_reports()[3])])
def test_default_views_are_static_figures_with_labelled_axes(make):
    fig = make()
    assert fig.axes
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


# ----- the chapters' views: one stage beside DP (ch. 2-4), ZeRO-R (ch. 5) ----------------
def paper_states(psi: float, nd: int, stage: int, k: int, width: int, nm: int = 1) -> dict:
    """Sec 5.1-5.3 by hand: each state is divided by Nd once its stage partitions it, and by Nm."""
    return {"params": width * psi / nm / (nd if stage >= 3 else 1),
            "grads": width * psi / nm / (nd if stage >= 2 else 1),
            "optimizer_states": k * psi / nm / (nd if stage >= 1 else 1)}


def test_stage_explorer_defaults_are_figure_1_for_each_chapter():
    for stage in (1, 2, 3):
        explorer = widgets.StageExplorer(stage=stage)
        rows = explorer.result["rows"]
        assert explorer.value("stage") == stage and set(rows) == {0, stage}
        # Psi = 7.5B, Nd = 64, K = 12: DP 120 GB; 31.4, 16.6, 1.9 GB as Fig 1 prints them.
        assert rows[0]["total"] == 16 * 7.5e9
        assert rows[stage]["total"] / GB == pytest.approx(FIGURE1_GB[stage], abs=0.05)
        assert f"<b>{shown(rows[stage]['total'])}</b> per device" in explorer.summary.value
        assert explorer.view.value[:4] == b"\x89PNG"
        # The text form a notebook stores for the view: its settings, nothing that varies.
        assert repr(explorer) == (f"StageExplorer(psi=7500000000.0, nd=64, stage={stage}, optimizer='adam', "
                                  "dtype='bf16')")


def test_stage_explorer_follows_the_papers_formulas():
    explorer = widgets.StageExplorer(stage=2)
    ranges = {"psi": PSIS, "nd": figures.NDS, "stage": [1, 2, 3], "optimizer": ["adam", "adamw", "sgd"],
              "dtype": ["bf16", "fp16", "fp32"]}
    for _ in sweep(explorer, ranges):
        psi, nd, stage, optimizer, dtype = (explorer.controls[n].value for n in ranges)
        width = 4 if dtype == "fp32" else 2
        # K (Sec 3.1): Adam's two fp32 moments or SGD's momentum, plus an fp32 master copy in mixed precision.
        k = (8 if optimizer in ("adam", "adamw") else 4) + (0 if dtype == "fp32" else 4)
        for s in (0, stage):
            row, expected = explorer.result["rows"][s], paper_states(psi, nd, s, k, width)
            for category, value in expected.items():
                assert row[category] == pytest.approx(value, rel=1e-12)
            assert row["total"] == pytest.approx(sum(expected.values()), rel=1e-12)
            volume = (3 if s == 3 else 2) * psi  # Sec 7.2: 2 Psi for DP, P_os, P_os+g; 3 Psi for P_os+g+p
            assert row["comm_elements"] == volume and row["comm_bytes"] == volume * width
            assert shown(row["total"]) in explorer.summary.value
        assert f"K = {k} bytes" in explorer.summary.value


def test_stage_2_gradients_shrink_as_one_over_nd_and_its_parameters_do_not():
    explorer = widgets.StageExplorer(stage=2, psi=1.5e9)
    assert len(figures.NDS) >= 2
    for nd in figures.NDS:
        explorer.controls["nd"].value = nd
        row = explorer.result["rows"][2]
        assert row["grads"] * nd == pytest.approx(2 * 1.5e9)  # 2 Psi / Nd (Sec 5.2)
        assert row["params"] == 2 * 1.5e9  # still replicated
        assert explorer.result["rows"][0]["grads"] == 2 * 1.5e9  # DP keeps every gradient


def test_stage_explorer_moves_three_psi_only_at_stage_3():
    explorer = widgets.StageExplorer(stage=1)
    for stage, multiple, said in [(1, 2, "as much as DP"), (2, 2, "as much as DP"), (3, 3, "1.5 x DP's")]:
        explorer.controls["stage"].value = stage
        assert explorer.result["rows"][stage]["comm_elements"] == multiple * 7.5e9
        assert f"{multiple} Psi = {shown(multiple * 7.5e9 * 2)}" in explorer.summary.value
        assert said in explorer.summary.value


def test_the_views_name_a_bad_setting():
    for bad in (0, 4, True):
        with pytest.raises(ConfigError, match=f"stage {bad}"):
            widgets.StageExplorer(stage=bad)
    with pytest.raises(ConfigError, match="nd 3: allowed are 1, 2, 4"):
        widgets.StageExplorer(nd=3)
    for kwargs, match in [({"nm": 3}, "nm 3: allowed are 1, 2, 4"), ({"stage": 5}, "stage 5"),
                          ({"gpu": "T4"}, "gpu 'T4'"), ({"psi": -1.0}, "psi -1.0")]:
        with pytest.raises(ConfigError, match=match):
            widgets.ResidualExplorer(**kwargs)


def checkpoint_bytes(hidden: int, layers: int, seq_len: int, batch: int) -> int:
    """Sec 3.2, 6.1: one checkpoint of batch x seq x hidden 2-byte values per block."""
    return batch * seq_len * hidden * layers * 2


def test_residual_explorer_default_is_sec_6_1s_100b_example():
    explorer = widgets.ResidualExplorer()
    new, old = explorer.result["with"], explorer.result["without"]
    # 125 x 8192, seq 1K, batch 16: about 33 GB of checkpoints per GPU, about 2 GB with P_a at Nm = 16.
    assert old["checkpoints"] == 16 * 1024 * 8192 * 125 * 2 == new["checkpoints_replicated"]
    assert old["checkpoints"] / GB == pytest.approx(33, abs=1) and new["checkpoints"] / GB == pytest.approx(2, abs=0.2)
    assert new["fits"] and not old["fits"]
    assert f"Activation checkpoints: <b>{shown(new['checkpoints'])}</b> on each GPU" in explorer.summary.value
    assert explorer.view.value[:4] == b"\x89PNG"
    assert repr(explorer).startswith("ResidualExplorer(psi=100000000000.0, nd=64, nm=16, stage=2,")


def test_p_a_divides_checkpoints_by_nm_and_p_a_cpu_leaves_none_on_the_device():
    explorer = widgets.ResidualExplorer()
    ranges = {"nm": formulas.NMS, "hidden": [1024, 12288], "layers": [24, 96], "seq_len": [512, 2048],
              "batch": [1, 8], "checkpoints": ["mp", "pa", "pa_cpu"]}
    for _ in sweep(explorer, ranges):
        nm, hidden, layers, seq_len, batch, where = (explorer.controls[n].value for n in ranges)
        full = checkpoint_bytes(hidden, layers, seq_len, batch)
        new = explorer.result["with"]
        assert new["checkpoints"] == {"mp": full, "pa": full / nm, "pa_cpu": 0}[where]
        assert new["checkpoints_host"] == (full / nm if where == "pa_cpu" else 0)
        assert explorer.result["without"]["checkpoints"] == full  # MP alone replicates it on all Nm GPUs
        assert f"<b>{shown(new['checkpoints'])}</b> on each GPU" in explorer.summary.value
        assert f"{shown(new['checkpoints_host'])} in host memory" in explorer.summary.value


def test_cb_caps_the_fused_buffer_that_otherwise_grows_with_psi():
    explorer = widgets.ResidualExplorer()
    ranges = {"psi": PSIS, "nm": [1, 16], "cb_mb": CB_MB, "cb": [False, True]}
    for _ in sweep(explorer, ranges):
        psi, nm, cap_mb, cb = (explorer.controls[n].value for n in ranges)
        fused = 4 * psi / nm  # every gradient of the GPU's Psi / Nm parameters in fp32 (Sec 3.2, 6.2)
        expected = min(fused, cap_mb * 1e6) if cb else fused
        assert explorer.result["with"]["buffer"] == pytest.approx(expected, rel=1e-12)
        assert explorer.result["without"]["buffer"] == pytest.approx(fused, rel=1e-12)
    set_values(explorer, cb=True, cb_mb=500, nm=1)
    for psi in PSIS[1:]:  # 1.5B and up: 6 GB and more uncapped, 0.5 GB with CB
        explorer.controls["psi"].value = psi
        assert explorer.result["with"]["buffer"] == 500e6


def test_md_removes_the_memory_lost_to_fragmentation_and_the_totals_add_up():
    explorer = widgets.ResidualExplorer()
    ranges = {"fragmentation": [0, 10, 30, 60], "gpu": list(figures.GPUS), "md": [False, True],
              "stage": [0, 1, 2, 3], "nd": [1, 64], "nm": [1, 16]}
    for _ in sweep(explorer, ranges):
        lost, gpu, md, stage, nd, nm = (explorer.controls[n].value for n in ranges)
        device, psi = figures.GPUS[gpu], explorer.value("psi")
        new, old = explorer.result["with"], explorer.result["without"]
        assert new["fragmentation"] == (0 if md else pytest.approx(lost / 100 * device))
        assert old["fragmentation"] == pytest.approx(lost / 100 * device)
        states = paper_states(psi, nd, stage, 12, 2, nm)
        for r in (new, old):
            for category, value in states.items():
                assert r[category] == pytest.approx(value, rel=1e-12)
            assert r["total"] == pytest.approx(sum(r[c] for c in formulas.RESIDUAL_CATEGORIES), rel=1e-12)
            assert r["fits"] == (r["total"] <= device)
        assert f"<b>{'fits' if new['fits'] else 'does not fit'}</b>" in explorer.summary.value
        assert shown(new["total"]) in explorer.summary.value and shown(old["total"]) in explorer.summary.value


@pytest.mark.parametrize(("call", "match"), [
    (lambda: formulas.stage_vs_dp(7.5e9, 64, 0), "stage 0"),
    (lambda: formulas.stage_vs_dp(7.5e9, 0, 1), "nd 0"),
    (lambda: formulas.residual_bytes(checkpoints="gpu"), "checkpoints 'gpu'"),
    (lambda: formulas.residual_bytes(nm=0), "nm 0"),
    (lambda: formulas.residual_bytes(fragmentation=1.5), "fragmentation 1.5"),
    (lambda: formulas.residual_bytes(fragmentation=-0.1), "fragmentation -0.1"),
    (lambda: formulas.residual_bytes(cb_bytes=0), "cb_bytes 0"),
    (lambda: formulas.residual_bytes(hidden=0), "hidden must be an integer >= 1, got 0"),
])
def test_the_chapters_views_name_a_bad_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("make", [formulas.stage_figure, lambda: formulas.stage_figure(stage=3),
                                  formulas.residual_figure])
def test_the_chapters_default_views_are_static_figures_with_labelled_axes(make):
    fig = make()
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


# ----- chapter 8: BeyondExplorer, no offload, CPU offload or disk offload ------------------------

def test_beyond_default_is_zero_offloads_13b_on_one_32gb_gpu():
    from zerolearn.widgets.beyond import BeyondExplorer

    explorer = BeyondExplorer()
    rows = {(r["stage"], r["offload"]): r for r in explorer.result["rows"]}
    # One GPU: every stage holds 16 bytes x 13e9 = 208 GB on it, far above 32 GB.
    assert not any(rows[(s, None)]["fits"] for s in (1, 2, 3))
    assert rows[(2, None)]["totals"]["device"] == pytest.approx(16 * 13e9)
    # ZeRO-2 + CPU offload keeps the 2-byte parameters on the GPU (26 GB) and 4 + 12 bytes
    # a parameter on the host (208 GB, within 256 GB).
    cpu = rows[(2, "cpu")]
    assert cpu["fits"] and cpu["totals"]["device"] == pytest.approx(2 * 13e9)
    assert cpu["totals"]["host"] == pytest.approx(16 * 13e9)
    assert explorer.result["best"] is cpu and "ZeRO-2 (P_os+g) + CPU offload" in explorer.summary.value
    assert shown(26e9) in explorer.summary.value
    assert explorer.view.layout.display == "none" and explorer.view.value == b""  # no figure drawn


def test_beyond_follows_every_control():
    from zerolearn.costmodel import HostSide, Job, offload_step_time
    from zerolearn.memory.model import offload_state_bytes
    from zerolearn.widgets.beyond import ASSUMED, GPU_GB, HOST_ADAM, HOST_GB, PCIE_GBPS, TOKENS_PER_GPU, BeyondExplorer

    explorer = BeyondExplorer()
    ranges = {"psi": [1e9, 7.5e9, 1e11], "nd": [1, 8, 64], "gpu_gb": GPU_GB[::3], "host_gb": HOST_GB[::4],
              "disk_GBps": [0.5, 25.0], "pcie_GBps": PCIE_GBPS[::3], "host_adam": HOST_ADAM[::2], "dpu": [False, True]}
    assert all(len(values) >= 2 for values in ranges.values()), ranges  # every control really moves
    moves = ((name, value) for name, values in ranges.items() for value in values)
    for name, value in moves:  # no figure to draw, so no deferral: every move refreshes
        explorer.controls[name].value = value
        c = {n: explorer.controls[n].value for n in ranges}
        host = HostSide(pcie_GBps=c["pcie_GBps"], host_adam_elements_per_s=c["host_adam"], disk_GBps=c["disk_GBps"])
        fitting = []
        for row in explorer.result["rows"]:
            placed = offload_state_bytes(c["psi"], c["nd"], row["stage"], row["offload"])
            assert row["bytes"] == placed
            device, host_bytes = sum(placed["device"].values()), sum(placed["host"].values())
            assert row["fits"] == (device <= c["gpu_gb"] * GB and host_bytes <= c["host_gb"] * GB), (name, value)
            job = Job(psi=c["psi"], tokens_per_gpu=TOKENS_PER_GPU, stage=row["stage"], nd=c["nd"])
            want = offload_step_time(job, ASSUMED, host, row["offload"], dpu=c["dpu"] and row["offload"] is not None)
            assert row["time"] == want
            if row["fits"]:
                fitting.append(row)
        best = explorer.result["best"]
        assert (best is None) == (not fitting)
        if best is not None:
            assert best["time"].step_s == min(r["time"].step_s for r in fitting)
            assert f"<b>{explorer.name(best)}</b>" in explorer.summary.value
        else:
            assert "<b>Nothing fits</b>" in explorer.summary.value


def test_beyond_dpu_is_never_slower_and_refuses_values_off_its_sliders():
    from zerolearn.widgets.beyond import BeyondExplorer

    explorer = BeyondExplorer(psi=7.5e9, nd=8)
    serial = {(r["stage"], r["offload"]): r["time"].step_s for r in explorer.result["rows"]}
    explorer.controls["dpu"].value = False
    assert all(r["time"].step_s >= serial[(r["stage"], r["offload"])] for r in explorer.result["rows"])
    for kwargs, match in (({"gpu_gb": 33}, "gpu_gb 33"), ({"nd": 3}, "nd 3"), ({"disk_GBps": 0}, "disk_GBps 0")):
        with pytest.raises(ConfigError, match=match):
            BeyondExplorer(**kwargs)


def test_a_stored_explorer_says_to_run_its_cell():
    """Where the view cannot be drawn (JupyterLab, notebook untrusted) its text form shows:
    the explorer's name and settings, then a line saying to run the cell."""
    from zerolearn.widgets.base import STORED_NOTE

    for explorer in (widgets.StageExplorer(stage=2), widgets.ResidualExplorer()):
        bundle = explorer._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        text = bundle["text/plain"]
        assert text.startswith(f"{type(explorer).__name__}(") and text.endswith(f"\n{STORED_NOTE}")


def test_fragmentation_simulator_says_what_it_waits_for_before_recording(monkeypatch, capsys):
    """The first simulator of a process records a trace (up to a minute): it prints a line first;
    once the trace is recorded it prints nothing and only replays."""
    from zerolearn.figures import measured
    from zerolearn.widgets.measured import PROGRESS

    small = [("alloc", 1, 4 * MIB, "setup"), ("alloc", 2, 8 * MIB, "forward"), ("alloc", 3, 2 * MIB, "forward"),
             ("free", 2, 8 * MIB, "backward"), ("alloc", 4, 12 * MIB, "step"), ("free", 3, 2 * MIB, "step")]
    order = []
    monkeypatch.setattr(measured, "trace_is_recorded", lambda: False)
    monkeypatch.setattr(figures, "recorded_trace", lambda: order.append(capsys.readouterr().out) or list(small))
    widgets.FragmentationSimulator()
    assert order == [PROGRESS + "\n"]  # printed before the recording started
    monkeypatch.setattr(measured, "trace_is_recorded", lambda: True)
    widgets.FragmentationSimulator()
    assert capsys.readouterr().out == ""
