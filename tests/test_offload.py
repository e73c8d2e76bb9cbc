"""Offload (ZeRO-Offload, ZeRO-Infinity's disk tier) and DPU on the engines of stages 1-3.

Offload moves where the optimizer's states live and where its step runs, not the
arithmetic: without DPU a run equals the plain stage's bit for bit in fp32. DPU is one
update stale by design: its parameters after step t are the plain run's after t - 1 on
the same gradients. Bytes by location equal the formula extended to offload.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import jobs
from jobs import on_ranks
from zerolearn import checkpoint, comm, data
from zerolearn import dist as zdist
from zerolearn.config import TrainConfig, build_parser
from zerolearn.engines import make_engine
from zerolearn.errors import ConfigError
from zerolearn.memory import model as analytic

pytestmark = pytest.mark.slow  # offload and DPU runs on ranks

STAGES = (1, 2, 3)
OFFLOADS = (None, "cpu", "disk")
STEPS = 3
MOMENTUM = 0.9  # SGD with a momentum buffer: a per-element state to offload besides the master


# ----- jobs (run on the ranks; importable by name) ---------------------------------------
def train(stage: int, offload: str | None = None, dpu: bool = False, dtype: str = "fp32", optimizer: str = "adam",
          steps: int = STEPS, accum: int = 1, max_grad_norm: float | None = None, model: str = "gpt") -> dict:
    """The small GPT (or ``model="frozen"``: jobs.PartlyFrozen, a frozen layer, a layer
    used on odd steps only, shards that need padding) for ``steps`` steps on this rank's
    slices; what the tests compare."""
    ctx = zdist.context()
    net = jobs.small_gpt() if model == "gpt" else jobs.frozen_model()
    engine = make_engine(stage, net, optimizer=optimizer, lr=jobs.LR[optimizer], dtype=dtype,
                         bucket_mb=0.01, max_grad_norm=max_grad_norm,
                         momentum=MOMENTUM if optimizer == "sgd" else 0.0, offload=offload, dpu=dpu)
    losses, io, after_backward = [], [], None
    for step in range(steps):
        batch = jobs.global_batch(step) if model == "gpt" else jobs.frozen_batch(step)
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch)
        local, gathered = 0.0, comm.LEDGER.ops["all_gather"].bytes
        for xm, ym in zip(x.chunk(accum), y.chunk(accum), strict=True):
            if model == "gpt":
                loss = jobs.gpt_loss(engine(xm), ym)
            else:
                loss = torch.nn.functional.mse_loss(engine(xm, step % 2 == 1).float(), ym)
            engine.backward(loss / accum)  # every micro-batch reduces: accumulation after the reduction
            local += loss.item() / accum
        after_backward = engine.model_state_bytes_by_location()
        engine.step()
        io.append({**engine.offload_stats(), "gathered": comm.LEDGER.ops["all_gather"].bytes - gathered})
        engine.zero_grad()
        losses.append(comm.monitor_mean(local))
    held = engine.model_state_bytes_by_location()
    for loc in held:
        held[loc]["grads"] = after_backward[loc]["grads"]
    with engine.offload_resident():  # stage 3 on disk: the shards are in their files between uses
        working = [(b.full if stage < 3 else b.shard).clone() for b in engine.buckets]
    out = {"losses": losses, "io": io, "bytes": held, "psi": engine.psi, "padding": engine.padding,
           "working": working}
    out["params"] = engine.full_state_dict()
    engine.close()
    return out


def many(runs: list[dict]) -> list[dict]:
    return [train(**kw) for kw in runs]


class Linear2(nn.Module):
    """Two linear maps summed: the loss is linear in the parameters, so every step's
    gradient is the same whatever the parameters are (two units at stage 3)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 5), nn.Linear(6, 3)

    def forward(self, x):
        return self.a(x[:, :8]).sum() + self.b(x[:, 8:]).sum()


def linear_run(stage: int, offload: str, dpu: bool, steps: int = 4) -> dict:
    """Working parameters of this rank (full buffers, shards at stage 3) after every step."""
    ctx = zdist.context()
    engine = make_engine(stage, Linear2(), optimizer="adam", lr=0.1, offload=offload, dpu=dpu, bucket_mb=0.0001)
    seen = []
    for t in range(steps):
        x = torch.randn(4, 14, generator=torch.Generator().manual_seed(t))
        engine.backward(engine(data.rank_slice(x, ctx.rank, ctx.world_size)))
        engine.step()
        engine.zero_grad()
        with engine.offload_resident():  # stage 3 on disk: the shards are in their files between uses
            seen.append([(b.full if stage < 3 else b.shard).clone() for b in engine.buckets])
    engine.finish_dpu()
    with engine.offload_resident():
        final = [(b.full if stage < 3 else b.shard).clone() for b in engine.buckets]
    engine.close()
    return {"seen": seen, "final": final}


def linear_runs() -> dict:
    return {(stage, offload, dpu): linear_run(stage, offload, dpu)
            for stage in STAGES for offload in ("cpu", "disk") for dpu in (False, True)}


def checkpoint_round_trip(directory: str) -> dict:
    """Disk offload: 2 steps, save (inside an offload_resident block, and alone), 2 more; a
    fresh engine loads the save made alone and takes the same 2.
    DPU: a save right after a step holds the update in flight, waited for."""
    ctx = zdist.context()

    def step(engine, t):
        x, y = (data.rank_slice(v, ctx.rank, ctx.world_size) for v in jobs.global_batch(t))
        engine.backward(jobs.gpt_loss(engine(x), y))
        engine.step()
        engine.zero_grad()

    def engine_of(**options):
        return make_engine(2, jobs.small_gpt(), optimizer="adam", lr=1e-2, bucket_mb=0.01, **options)

    a = engine_of(offload="disk")
    for t in range(2):
        step(a, t)
    with a.offload_resident():  # a save inside the caller's own block: blocks nest
        checkpoint.save(a, os.path.join(directory, "disk_nested"), 2)
    checkpoint.save(a, os.path.join(directory, "disk"), 2)  # alone: the save reads the files in itself
    for t in range(2, 4):
        step(a, t)
    b = engine_of(offload="disk")
    checkpoint.load(b, os.path.join(directory, "disk", "step_00000002"))
    for t in range(2, 4):
        step(b, t)
    disk = (a.full_state_dict(), b.full_state_dict())
    a.close(), b.close()

    d = engine_of(offload="cpu", dpu=True)
    for t in range(3):
        step(d, t)
    checkpoint.save(d, os.path.join(directory, "dpu"), 3)  # reads engine.optimizer: waits for the step in flight
    d.finish_dpu()
    plain = engine_of()
    checkpoint.load(plain, os.path.join(directory, "dpu", "step_00000003"))
    dpu = (d.full_state_dict(), plain.full_state_dict(),
           {n: p.detach().clone() for n, p in d.model.named_parameters()},
           {n: p.detach().clone() for n, p in plain.model.named_parameters()})
    d.close()
    return {"disk": disk, "dpu": dpu}


# ----- the runs ------------------------------------------------------------------------------
RUNS = ([dict(stage=s, offload=o, optimizer=opt) for s in STAGES for o in OFFLOADS for opt in ("adam", "sgd")]
        + [dict(stage=s, offload=o, dtype="bf16") for s in STAGES for o in OFFLOADS]
        + [dict(stage=2, offload=o, accum=2, max_grad_norm=0.5) for o in (None, "disk")]
        + [dict(stage=s, offload=o, model="frozen", steps=4) for s in STAGES for o in OFFLOADS]
        + [dict(stage=s, offload="cpu", dpu=True, steps=6) for s in (2,)] + [dict(stage=2, steps=6)])


@functools.cache
def results() -> list[list[dict]]:
    return on_ranks(many, 2, RUNS)


def run_of(rank: int = 0, **kw) -> dict:
    return results()[rank][RUNS.index(kw)]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("stage", STAGES)
def test_offload_equals_the_plain_stage_bit_for_bit_in_fp32(stage, offload, optimizer):
    for rank in range(2):
        plain, off = run_of(rank, stage=stage, offload=None, optimizer=optimizer), \
            run_of(rank, stage=stage, offload=offload, optimizer=optimizer)
        assert off["losses"] == plain["losses"], rank
        assert plain["losses"][-1] < plain["losses"][0]  # it trained
        assert same(off["params"], plain["params"]), rank
        assert all(torch.equal(a, b) for a, b in zip(off["working"], plain["working"], strict=True)), rank


def test_offload_with_accumulation_and_clipping_equals_the_plain_stage():
    plain, off = run_of(stage=2, offload=None, accum=2, max_grad_norm=0.5), \
        run_of(stage=2, offload="disk", accum=2, max_grad_norm=0.5)
    assert off["losses"] == plain["losses"]
    assert same(off["params"], plain["params"])


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("stage", STAGES)
def test_offload_with_unused_and_frozen_parameters_and_padding_equals_the_plain_stage(stage, offload):
    k = analytic.optimizer_k("adam", "bf16")
    for rank in range(2):
        plain = run_of(rank, stage=stage, offload=None, model="frozen", steps=4)
        off = run_of(rank, stage=stage, offload=offload, model="frozen", steps=4)
        assert off["padding"] > 0  # 119 trainable elements do not split in 2: the formula counts the padding
        assert off["losses"] == plain["losses"] and same(off["params"], plain["params"]), rank
        assert off["bytes"] == analytic.offload_state_bytes(off["psi"] + off["padding"], 2, stage, offload, "fp32", k)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("stage", STAGES)
def test_offload_in_bf16_matches_the_plain_stage_to_bf16_precision(stage, offload):
    plain, off = run_of(stage=stage, offload=None, dtype="bf16"), run_of(stage=stage, offload=offload, dtype="bf16")
    eps = torch.finfo(torch.bfloat16).eps
    assert plain["losses"] and plain["params"]
    for (a, b) in zip(off["losses"], plain["losses"], strict=True):
        assert abs(a - b) <= 4 * eps * abs(b)
    torch.testing.assert_close(off["params"], plain["params"], rtol=4 * eps, atol=4 * eps)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("stage", STAGES)
def test_bytes_by_location_equal_the_formula(stage, offload, dtype):
    k = analytic.optimizer_k("adam", "bf16" if offload else dtype)  # offload: the master is its own tensor
    for rank in range(2):
        run = run_of(rank, stage=stage, offload=offload, **({"dtype": dtype} if dtype == "bf16" else
                                                             {"optimizer": "adam"}))
        # Flat buffers hold Psi + padding elements; the formula with that count is exact.
        assert run["bytes"] == analytic.offload_state_bytes(run["psi"] + run["padding"], 2, stage, offload, dtype, k)


@pytest.mark.parametrize("stage", STAGES)
def test_disk_reads_and_writes_the_optimizer_states_once_per_step(stage):
    run = run_of(stage=stage, offload="disk", optimizer="adam")
    states = run["bytes"]["disk"]["optimizer_states"]  # master + both moments, as the files hold them
    shard = run["psi"] + run["padding"]
    assert states == 12 * shard // 2
    first, *later = run["io"]
    assert first["bytes_read"] == 4 * shard // 2  # the master alone: torch creates the moments in step 0
    assert first["bytes_written"] == states
    for io in later:
        assert io["bytes_read"] == io["bytes_written"] == states
        assert io["io_seconds"] > 0 and io["read_bandwidth"] > 0 and io["write_bandwidth"] > 0
    assert run_of(stage=stage, offload="cpu", optimizer="adam")["io"][-1]["bytes_read"] == 0
    # Stage 3 on disk (ZeRO-Infinity): a shard is read for every all_gather of its bucket
    # (whose output is Nd shards) and written once, after the step updated it.
    for io in run["io"]:
        if stage == 3:
            assert io["param_bytes_read"] * 2 == io["gathered"] > 0
            assert io["param_bytes_written"] == 4 * shard // 2
        else:
            assert io["param_bytes_read"] == io["param_bytes_written"] == 0


def test_dpu_parameters_are_one_update_behind_on_the_same_gradients():
    results = on_ranks(linear_runs, 2)
    assert len(results) == 2
    for rank, runs in enumerate(results):
        for stage in STAGES:
            for offload in ("cpu", "disk"):
                plain, dpu = runs[(stage, offload, False)], runs[(stage, offload, True)]
                steps = len(plain["seen"])
                assert steps >= 2 and len(dpu["seen"]) == steps, (rank, stage, offload)
                for t in range(1, steps):  # the plain run moves every step: the check is not vacuous
                    assert not all(torch.equal(a, b)
                                   for a, b in zip(plain["seen"][t], plain["seen"][t - 1], strict=True))
                for t in range(steps):  # step 0 is synchronous; then one update behind
                    behind = plain["seen"][max(t - 1, 0)]
                    assert all(torch.equal(a, b) for a, b in zip(dpu["seen"][t], behind, strict=True)), \
                        (rank, stage, offload, t)
                # finish_dpu publishes the update in flight: the plain run's last parameters
                assert all(torch.equal(a, b) for a, b in zip(dpu["final"], plain["seen"][-1], strict=True))


def test_dpu_loss_curve_is_measured_beside_the_plain_one():
    plain, dpu = run_of(stage=2, steps=6), run_of(stage=2, offload="cpu", dpu=True, steps=6)
    # Steps 0 and 1 see the same parameters (step 0's update is synchronous)...
    assert dpu["losses"][:2] == plain["losses"][:2]
    # ...from step 2 on, forward and backward use parameters one update stale.
    assert all(a != b for a, b in zip(dpu["losses"][2:], plain["losses"][2:], strict=True))
    assert dpu["losses"][-1] < dpu["losses"][0]  # it still trains


@pytest.mark.slow  # a checkpoint round trip (tests/conftest.py)
def test_checkpoint_round_trip_with_disk_offload_and_dpu(tmp_path):
    out = on_ranks(checkpoint_round_trip, 2, str(tmp_path))
    for rank in range(2):
        continued, resumed = out[rank]["disk"]
        assert same(continued, resumed), rank  # masters and moments came back from the files
        masters, loaded, working, loaded_working = out[rank]["dpu"]
        assert same(masters, loaded), rank  # the save held the finished update, not a stale one
        assert same(working, loaded_working), rank


# ----- bad options: refused before any collective -----------------------------------------
@pytest.fixture
def no_process_group(monkeypatch):
    """Any use of the process group fails the test: options must be refused before."""
    def reached(*args, **kwargs):
        raise AssertionError("the engine reached the process group before refusing its options")

    for name in ("get_rank", "get_world_size", "all_reduce", "all_gather_single", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, reached)


@pytest.mark.parametrize("stage, options, words", [
    (0, {"offload": "cpu"}, ["--offload 'cpu' at stage 0", "allowed at stages 1, 2, 3"]),
    (2, {"offload": "gpu"}, ["--offload 'gpu'", "allowed are None (no offload), 'cpu', 'disk'"]),
    (2, {"dpu": True}, ["--dpu needs --offload cpu or --offload disk"]),
    (2, {"dpu": "yes", "offload": "cpu"}, ["--dpu 'yes'", "allowed are True, False"]),
    (3, {"offload": "cpu", "offload_dir": "/tmp"}, ["--offload-dir '/tmp' needs --offload disk"]),
])
def test_bad_options_raise_config_error_before_any_collective(no_process_group, stage, options, words):
    with pytest.raises(ConfigError) as e:
        make_engine(stage, jobs.small_gpt(), **options)
    for w in words:
        assert w in str(e.value)


def test_an_offload_dir_that_cannot_be_written_is_refused(no_process_group, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="--offload-dir .*a_file/sub: not a writable folder"):
        make_engine(2, jobs.small_gpt(), offload="disk", offload_dir=str(blocker / "sub"))
    with pytest.raises(ConfigError, match="--offload-dir"):
        TrainConfig(stage=2, offload="disk", offload_dir=str(blocker / "sub")).validate(1)


def test_train_config_and_cli_carry_the_offload_options():
    help_text = build_parser().format_help()
    for flag in ("--offload {cpu,disk}", "--offload-dir D", "--dpu"):
        assert flag in help_text
    config = TrainConfig(stage=3, offload="disk", offload_dir="runs/off", dpu=True)
    assert TrainConfig.from_argv(config.to_argv()) == config
    for bad, message in [(dict(stage=0, offload="cpu"), "--offload cpu with --stage 0"),
                         (dict(stage=2, dpu=True), "--dpu needs --offload"),
                         (dict(stage=2, offload="nvme"), "--offload 'nvme': allowed are cpu, disk"),
                         (dict(stage=2, offload="cpu", offload_dir="x"), "--offload-dir x needs --offload disk")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            TrainConfig(**bad)


def test_the_offload_formula_extends_sec_5():
    psi, nd, k = 1_200_000, 4, 12
    for stage in (1, 2, 3):
        plain = analytic.model_state_bytes(psi, nd, stage, k)
        none = analytic.offload_state_bytes(psi, nd, stage, None, "bf16", k)
        assert none["device"] == {c: plain[c] for c in ("params", "grads", "optimizer_states")}
        cpu = analytic.offload_state_bytes(psi, nd, stage, "cpu", "bf16", k)
        disk = analytic.offload_state_bytes(psi, nd, stage, "disk", "bf16", k)
        assert cpu["device"]["params"] == plain["params"] and cpu["device"]["optimizer_states"] == 0
        assert cpu["device"]["grads"] == (plain["grads"] if stage == 1 else 0)
        assert cpu["host"] == {"params": 0, "grads": 4 * psi // nd, "optimizer_states": plain["optimizer_states"]}
        # Stage 3 on disk: the working parameter shards move from the device to disk (ZeRO-Infinity).
        moved = plain["params"] if stage == 3 else 0
        assert disk["device"] == {**cpu["device"], "params": cpu["device"]["params"] - moved}
        assert disk["host"]["optimizer_states"] == 0
        assert disk["disk"] == {"params": moved, "grads": 0, "optimizer_states": cpu["host"]["optimizer_states"]}
    with pytest.raises(ValueError, match="stage 0"):
        analytic.offload_state_bytes(psi, nd, 0, "cpu")
    with pytest.raises(ValueError, match="offload must be one of"):
        analytic.offload_state_bytes(psi, nd, 2, "nvme")


def default_dir_job() -> tuple:
    engine = make_engine(2, jobs.small_gpt(), offload="disk", bucket_mb=0.01)
    folder = engine._offload.swapper.dir
    before = (os.path.isdir(folder), engine.model_state_bytes_by_location()["disk"]["optimizer_states"])
    engine.close()
    return before, os.path.exists(folder)


def test_a_default_offload_dir_is_removed_on_close():
    (existed, disk_bytes), exists_after = on_ranks(default_dir_job, 2)[0]
    assert existed and disk_bytes > 0
    assert not exists_after


def test_the_offload_table_measures_each_option_beside_the_formula():
    from zerolearn.experiments.offload import format_offload_table, offload_rows, offload_table

    rows = on_ranks(offload_rows, 2, 2, steps=3, d_model=32)[0]
    assert [r["option"] for r in rows] == ["none", "cpu", "disk", "cpu+dpu"]
    for r in rows:
        for loc in ("device", "host", "disk"):
            assert r[f"{loc} B"] == r[f"{loc} formula B"], (r["option"], loc)
        assert (r["max |loss diff|"] > 0) == (r["option"] == "cpu+dpu")  # DPU is one update stale from step 2
    disk = rows[2]
    assert disk["bytes_read"] == disk["bytes_written"] == disk["disk B"] > 0
    assert "cpu+dpu" in format_offload_table(rows)
    with pytest.raises(ConfigError, match="stage=0"):
        offload_table(stage=0)


# ----- the memory ledger splits device and host ---------------------------------------------
def ledger_job(offload: str | None) -> dict:
    """Stage 2 for 2 steps under a MemoryLedger: its bytes per location beside the engine's."""
    from zerolearn.memory.ledger import MemoryLedger

    ctx = zdist.context()
    engine = make_engine(2, jobs.small_gpt(), optimizer="adam", lr=1e-2, bucket_mb=0.01, offload=offload)
    with MemoryLedger(record_timeline=False) as ledger:
        ledger.track_engine(engine)
        for t in range(2):
            x, y = (data.rank_slice(v, ctx.rank, ctx.world_size) for v in jobs.global_batch(t))
            engine.backward(jobs.gpt_loss(engine(x), y))
            engine.step()
            engine.zero_grad()
        seen = ledger.by_location()["live"]
    held = engine.model_state_bytes_by_location()
    engine.close()
    return {"ledger": seen, "engine": held}


@pytest.mark.parametrize("offload", [None, "cpu", "disk"])
def test_the_memory_ledger_splits_every_category_into_device_and_host(offload):
    results = on_ranks(ledger_job, 2, offload)
    assert len(results) == 2
    for r in results:
        for where in ("device", "host"):
            for c in ("params", "optimizer_states"):  # what stays between steps (grads: dropped by zero_grad)
                assert r["ledger"][where][c] == r["engine"][where][c], (where, c)
        if offload == "cpu":  # the master and both moments, fp32, on the host; none on the device
            assert r["ledger"]["host"]["optimizer_states"] > 0 == r["ledger"]["device"]["optimizer_states"]
        if offload is None:
            assert not any(r["ledger"]["host"].values())
