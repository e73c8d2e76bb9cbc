"""Checkpoints that lose nothing: resharding N -> M ranks and stage S -> S', consolidation,
crash-safe saves, and bad input refused before any parameter changes."""

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jobs
from jobs import on_ranks
from zerolearn import checkpoint, cli
from zerolearn.checkpoint import __main__ as checkpoint_cli
from zerolearn.checkpoint.checksums import NO_CHECKSUMS
from zerolearn.config import TrainConfig
from zerolearn.dist import RankError, launch

pytestmark = pytest.mark.slow  # checkpoint round trips on up to 4 ranks

SAVE_AT, LAST = 3, 6
OPTIMIZERS = ("adam", "sgd")
HOPS = ("s2n2", "s3n4", "s1n1")  # stage and world size of each checkpoint in the chain


BIG_MLP = (1024, 4)  # width, layers: 4.2M parameters


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """Save at stage 2 on 2 ranks; load at stage 3 on 4 ranks (and save that); load that
    at stage 1 on 1 rank (and save that). Each loader trains on to step LAST. An fp16
    run saved at stage 2 is loaded at stage 0, for the loss scaler. (The first launch
    also runs the jobs of the bad-input and memory tests: spawning ranks is the slow part.)"""
    d = tmp_path_factory.mktemp("chain")
    path = {f"{o}{k}": str(d / f"{o}{k}") for o in (*OPTIMIZERS, "fp16") for k in HOPS}
    out = {}
    calls = [("ckpt_save_after", dict(stage=2, optimizer=o, steps=SAVE_AT, directory=path[f"{o}s2n2"]))
             for o in OPTIMIZERS]
    calls.append(("ckpt_save_after", dict(stage=2, optimizer="adam", steps=SAVE_AT, dtype="fp16",
                                          directory=path["fp16s2n2"])))
    calls += [("ckpt_bad_inputs", dict(directory=str(d / "bad"))),
              ("ckpt_big_mlp", dict(directory=str(d / "big"), width=BIG_MLP[0], layers=BIG_MLP[1]))]
    first = on_ranks(jobs.several, 2, calls)
    out["s2n2"] = [r[:3] for r in first]
    out["bad_inputs"] = [r[3] for r in first]
    out["big_psi"], path["big"] = first[0][4], str(d / "big")
    out["s3n4"] = on_ranks(jobs.several, 4, [
        ("ckpt_resume", dict(stage=3, optimizer=o, directory=path[f"{o}s2n2"], last=LAST,
                             save_to=path[f"{o}s3n4"])) for o in OPTIMIZERS])
    out["s1n1"] = on_ranks(jobs.several, 1, [
        *[("ckpt_resume", dict(stage=1, optimizer=o, directory=path[f"{o}s3n4"], last=LAST,
                               save_to=path[f"{o}s1n1"])) for o in OPTIMIZERS],
        ("ckpt_resume", dict(stage=0, optimizer="adam", dtype="fp16", directory=path["fp16s2n2"], last=SAVE_AT))])
    return {"path": path, "out": out}


@functools.cache
def reference(optimizer: str) -> list[float]:
    return jobs.ckpt_reference(optimizer, LAST)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("hop", HOPS[1:])
def test_resharded_run_continues_with_the_losses_of_an_uninterrupted_one(chain, optimizer, hop):
    # stage 2 on 2 ranks -> stage 3 on 4 -> stage 1 on 1: every loader
    # trains steps 3-5 with the losses of plain PyTorch trained 6 steps without a break.
    # (Lost Adam moments, momentum buffers or step counts would change them.)
    ranks = chain["out"][hop]
    assert len(ranks) == int(hop.split("n")[1])  # one result per rank of the loader
    for rank, result in enumerate(ranks):
        run = result[OPTIMIZERS.index(optimizer)]
        assert run["first"] == SAVE_AT
        assert run["losses"] == pytest.approx(reference(optimizer)[SAVE_AT:], rel=1e-5), rank
        if optimizer == "adam":
            assert run["adam_steps"] == [float(SAVE_AT)]


def test_saved_losses_match_plain_pytorch(chain):
    saved = chain["out"]["s2n2"][0][:len(OPTIMIZERS)]  # then the fp16 run
    for optimizer, run in zip(OPTIMIZERS, saved, strict=True):
        assert run["losses"] == pytest.approx(reference(optimizer)[:SAVE_AT], rel=1e-5)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resharding_round_trip_is_exact(chain, optimizer):
    # 2 ranks stage 2 -> 4 ranks stage 3 -> 1 rank stage 1: every master and optimizer
    # state element comes back bit for bit, and matches what each engine loaded.
    p = chain["path"]
    keys = {"adam": ("master", "exp_avg", "exp_avg_sq"), "sgd": ("master", "momentum_buffer")}[optimizer]
    assert checkpoint.manifest(p[optimizer + "s2n2"]).state_keys == tuple(sorted(keys[1:]))
    for key in keys:
        saved = [checkpoint.read_full(p[optimizer + hop], key) for hop in HOPS]
        for name, value in saved[0].items():
            assert all(torch.equal(value, other[name]) for other in saved[1:]), (key, name)
    masters = checkpoint.read_full(p[optimizer + "s2n2"])
    for hop in HOPS[1:]:
        loaded = chain["out"][hop][-1][OPTIMIZERS.index(optimizer)]["loaded"]
        assert all(torch.equal(masters[n], loaded[n]) for n in masters), hop


def test_manifest_records_stage_world_size_and_pieces(chain):
    man = checkpoint.manifest(chain["path"]["adams3n4"])
    assert (man.step, man.stage, man.world_size) == (SAVE_AT, 3, 4)
    assert [f.rank for f in man.files] == [0, 1, 2, 3]
    assert all(sorted(p.rank for p in g.pieces) == [0, 1, 2, 3] for g in man.groups)
    stage2 = checkpoint.manifest(chain["path"]["adams2n2"])
    assert stage2.extra == {"note": "test"} and stage2.world_size == 2


def test_fp16_loss_scale_is_restored(chain):
    saved = chain["out"]["s2n2"][0][-1]["scaler"]
    loaded = chain["out"]["s1n1"][0][-1]["scaler"]
    assert saved["clean_steps"] == SAVE_AT or saved["skipped_steps"] > 0  # not a fresh scaler
    assert loaded == saved


def test_consolidated_four_rank_stage3_checkpoint_loads_strictly_into_the_plain_model(chain, tmp_path):
    src = chain["path"]["adams3n4"]
    out = tmp_path / "model.pt"
    done = subprocess.run([sys.executable, "-m", "zerolearn.checkpoint", "consolidate", src, str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "stage 3, 4 rank(s)" in done.stdout
    model = jobs.small_gpt(seed=3)  # other weights, all to be replaced
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    loaded = chain["out"]["s3n4"][0][0]["loaded"]  # what the 4-rank engine held
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), loaded[name]), name
    # The plain model computes the loss the 4-rank engine computed at the same step.
    x, y = jobs.global_batch(SAVE_AT)
    assert jobs.gpt_loss(model(x), y).item() == pytest.approx(chain["out"]["s3n4"][0][0]["losses"][0], rel=1e-5)


def test_consolidation_streams_shard_by_shard(chain, tmp_path):
    # A 4.2M-parameter MLP saved by 2 stage-3 ranks with Adam: 3 fp32 copies (master and
    # two moments), 50 MiB on disk. Consolidation reads the masters only, one rank file
    # at a time: its peak stays near the output (16.8 MB) plus one shard (8.4 MB), far
    # below reading every file whole (50 MB + the output).
    psi, src = chain["out"]["big_psi"], chain["path"]["big"]
    script = ("import resource, sys, torch; from zerolearn import checkpoint\n"
              "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "checkpoint.consolidate(sys.argv[1], sys.argv[2])\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)")
    done = subprocess.run([sys.executable, "-c", script, src, str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux
    on_disk = sum(f.stat().st_size for f in Path(src).rglob("rank_*.pt"))
    output, shard = psi * 4, psi * 4 / 2
    assert on_disk > 2.9 * output
    assert grown < output + shard + 8 * 2**20, (grown, output, shard)
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sum(t.numel() for t in state.values()) == psi


def test_a_crash_during_a_save_leaves_the_last_good_checkpoint(tmp_path):
    d = tmp_path / "ck"
    with pytest.raises(RankError) as info:
        launch(jobs.ckpt_crash_during_save, 2, str(d))
    assert info.value.rank == 1
    assert os.path.basename(checkpoint.latest(str(d))) == "step_00000002"
    assert (d / ".step_00000004.tmp").is_dir()  # the half-written save, never renamed
    assert checkpoint.manifest(str(d)).step == 2
    assert len(checkpoint.read_full(str(d))) == len(list(jobs.small_gpt().parameters()))
    # The next run (stage 2 on one rank) resumes from step 2; its first save clears the debris.
    run = on_ranks(jobs.ckpt_resume, 1, 2, "adam", str(d), 4, str(d))[0]
    assert run["first"] == 2 and run["losses"] == pytest.approx(jobs.ckpt_reference("adam", 4)[2:], rel=1e-5)
    assert not (d / ".step_00000004.tmp").exists()


@pytest.mark.parametrize("case, message", [
    ("missing_shard", r"shard rank_00001.pt of rank 1 \(of 2\) is missing"),
    ("truncated", "rank_00000.pt: .* bytes, the manifest says .*: the file is truncated"),
    ("fewer_layers", "saved from another model: .*missing from the checkpoint: blocks.1"),
    ("narrower", r"saved from another model: .*embed.tok.weight: checkpoint \[256, 16\], this model \[256, 32\]"),
    ("sgd", "holds sgd state; this engine uses adam"),
    ("world_size", r"manifest.json: files: world size 3 but rank files for ranks \[0, 1\]; this checkpoint cannot "
                   "be mapped"),
    # world_size 1 with rank 1's pieces dropped: the shard files' recorded world size gives it away.
    ("uncovered", r"manifest.json: files\[0\].world_size: 2, but the manifest's world_size is 1"),
    ("garbled_manifest", "manifest.json: cannot be read as JSON"),
    ("empty", "no complete checkpoint"),
])
def test_bad_checkpoint_is_refused_before_any_parameter_changes(chain, case, message):
    bad_inputs = chain["out"]["bad_inputs"]
    for rank, result in enumerate(bad_inputs):
        assert result["messages"][case] is not None, (case, rank)
        assert re.search(message, result["messages"][case]), result["messages"][case]
        assert result["untouched"], rank
    # Every rank refused, and stayed in step with the others: training went on.
    assert bad_inputs[0]["losses"] == bad_inputs[1]["losses"]


def test_consolidate_cli_refuses_a_damaged_checkpoint_with_exit_2(chain, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint.latest(chain["path"]["adams3n4"]), bad)
    (bad / "rank_00002.pt").unlink()
    with pytest.raises(SystemExit) as info:
        checkpoint_cli.main(["consolidate", str(bad), str(tmp_path / "x.pt")])
    assert info.value.code == 2
    assert "shard rank_00002.pt of rank 2 (of 4) is missing" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("args, message", [
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-dir", "x", "--checkpoint-every", "-1"], "--checkpoint-every -1: must be an integer >= 0"),
    (["--fail-at-step", "1", "--fail-rank", "1"], "--fail-rank 1: allowed are 0 to 0 (world size 1)"),
])
def test_bad_checkpoint_options_exit_2_before_any_work(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ----- checksums, fallback, non-finite losses (issue 17) --------------------------------

SMALL = TrainConfig(global_batch_size=4, seq_len=16, d_model=32, n_head=2, bucket_mb=0.01, quiet=True)
TRAIN = SMALL.to_argv()  # the same run on the command line
SAVED = SMALL.replace(stage=2, steps=4, checkpoint_every=2, checkpoint_keep=0, checkpoint_dir="unset")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """2 ranks at stage 2 train 4 steps, saving after steps 2 and 4 (both kept)."""
    d = tmp_path_factory.mktemp("verify") / "ck"
    report = on_ranks(jobs.train_jobs, 2, [SAVED.replace(checkpoint_dir=str(d))])[0][0]
    return {"dir": d, "losses": report["losses"]}


def damaged(saved, tmp_path, case: str) -> Path:
    """A copy of the saved folder whose step-4 checkpoint is damaged as ``case`` says."""
    d = tmp_path / "ck"
    shutil.copytree(saved["dir"], d)
    new, old = d / "step_00000004", d / "step_00000002"
    if case == "flip":  # one bit of one byte in the middle of rank 1's shard
        data = bytearray((new / "rank_00001.pt").read_bytes())
        data[len(data) // 2] ^= 0x10
        (new / "rank_00001.pt").write_bytes(bytes(data))
    elif case == "truncate":
        data = (new / "rank_00000.pt").read_bytes()
        (new / "rank_00000.pt").write_bytes(data[:len(data) // 2])
    elif case == "swap":
        os.replace(new / "rank_00000.pt", new / "tmp")
        os.replace(new / "rank_00001.pt", new / "rank_00000.pt")
        os.replace(new / "tmp", new / "rank_00001.pt")
    elif case == "other_step":  # rank 1's shard of step 2, as if restored from an old backup
        shutil.copyfile(old / "rank_00001.pt", new / "rank_00001.pt")
    return d


DAMAGE = {
    "flip": r"step_00000004/rank_00001.pt: SHA-256 [0-9a-f]{16}\.\.\. differs from the manifest's [0-9a-f]{16}",
    "truncate": r"step_00000004/rank_00000.pt: \d+ bytes, the manifest says \d+: the file is truncated",
    "swap": r"step_00000004/rank_00000.pt: its content is that of rank_00001.pt as saved, not rank 0's",
    "other_step": r"step_00000004/rank_00001.pt: holds the shard of step 2 \(the manifest says 4\).*another checkpoint",
}


def test_manifest_records_each_shards_checksum_and_owner(saved):
    import hashlib

    man = checkpoint.manifest(str(saved["dir"]))
    for rank, entry in enumerate(man.files):
        data = (saved["dir"] / "step_00000004" / entry.file).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.bytes == len(data)
        assert entry.identity() == {
            "rank": rank, "step": 4, "world_size": 2, "stage": 2, "dtype": "fp32"}
    assert checkpoint.verify(checkpoint.latest(str(saved["dir"]))) is True


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_shard_is_named_by_verify_info_and_consolidate(saved, tmp_path, capsys, case):
    d = damaged(saved, tmp_path, case)
    with pytest.raises(checkpoint.CheckpointError, match=DAMAGE[case]):
        checkpoint.verify(str(d / "step_00000004"))
    for argv in (["info", str(d)], ["consolidate", str(d), str(tmp_path / "x.pt")]):
        with pytest.raises(SystemExit) as info:
            checkpoint_cli.main(argv)
        assert info.value.code == 2, argv
        assert re.search(DAMAGE[case], capsys.readouterr().err), argv
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.pt.part").exists()
    checkpoint.verify(str(d / "step_00000002"))  # the older checkpoint is untouched


def test_cli_exits_2_on_a_flipped_byte_in_a_real_process(saved, tmp_path):
    d = damaged(saved, tmp_path, "flip")
    done = subprocess.run([sys.executable, "-m", "zerolearn.checkpoint", "consolidate", str(d),
                           str(tmp_path / "x.pt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and re.search(DAMAGE["flip"], done.stderr), done.stderr
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # neither x.pt nor x.pt.part


def test_a_failed_write_leaves_no_part_file(tmp_path):
    from zerolearn.checkpoint.files import write_atomic

    def fail(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_atomic(str(tmp_path / "x.pt"), fail)
    assert os.listdir(tmp_path) == []


def save_that_is_damaged_on_disk(directory: str) -> tuple[str, list[str]]:
    """(launched) Save step 1, then step 2 with keep=1, with a bit of step 2's shard
    flipped on disk just before it is read back: the save fails, step 1 is kept."""
    from zerolearn.checkpoint import engine_io

    engine = jobs.ckpt_engine(0, "adam")
    jobs.ckpt_steps(engine, 0, 1)
    checkpoint.save(engine, directory, 1, keep=1)
    jobs.ckpt_steps(engine, 1, 2)
    real = engine_io.verify

    def flip_then_verify(path, *args):
        with open(os.path.join(path, "rank_00000.pt"), "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 1]))
        return real(path, *args)
    engine_io.verify = flip_then_verify
    try:
        checkpoint.save(engine, directory, 2, keep=1)
        message = None
    except checkpoint.CheckpointWriteError as e:  # a runtime failure (exit 1), not bad input
        message = str(e)
    finally:
        engine_io.verify = real
    return message, sorted(os.listdir(directory))


def test_old_checkpoints_are_pruned_only_after_the_new_one_verifies(tmp_path):
    message, names = on_ranks(save_that_is_damaged_on_disk, 1, str(tmp_path / "ck"))[0]
    assert re.search(r"step_00000002 not written: rank 0: it did not verify when read back, older checkpoints "
                     r"kept: .*step_00000002/rank_00000.pt: SHA-256", message), message
    assert names == [".lock", "step_00000001"]  # .lock: taken while removing leftovers of crashed saves
    checkpoint.verify(str(tmp_path / "ck" / "step_00000001"))


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(saved, tmp_path, capfd):
    # Rank 1's step-4 shard has a flipped bit: both ranks resume from step 2 (rank 0
    # decides), say so once, and train steps 2-3 with the losses of the first run.
    d = damaged(saved, tmp_path, "flip")
    report = launch(jobs.train_jobs, 2, [SAVED.replace(checkpoint_dir=str(d))])[0][0]
    assert report["first_step"] == 2 and report["losses"] == saved["losses"][2:]
    err = capfd.readouterr().err
    line = f"checkpoint {d / 'step_00000004'} fails verification, resuming from {d / 'step_00000002'} instead"
    assert err.count(line) == 1, err
    assert re.search(DAMAGE["flip"], err)
    checkpoint.verify(str(d / "step_00000004"))  # saved again, whole


def test_no_checkpoint_that_verifies_is_an_error_naming_each(saved, tmp_path):
    d = damaged(saved, tmp_path, "flip")
    (d / "step_00000002" / "rank_00000.pt").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="none of its 2 checkpoint.* verifies: .*rank_00001.pt"
                                                           ".*step_00000002/rank_00000.pt: 0 bytes"):
        checkpoint.choose(str(d))


def test_checkpoint_without_checksums_still_loads_and_says_so(saved, tmp_path, capfd):
    import json

    d = damaged(saved, tmp_path, "none")
    for step in ("step_00000002", "step_00000004"):
        name = d / step / "manifest.json"
        man = json.loads(name.read_text())
        for entry in man["files"]:  # as an older zerolearn wrote it
            entry.pop("sha256")
        name.write_text(json.dumps(man))
    assert checkpoint.verify(str(d / "step_00000004")) is False
    assert checkpoint.choose(str(d)) == (str(d / "step_00000004"), f"{d / 'step_00000004'}: {NO_CHECKSUMS}", [])
    assert checkpoint_cli.main(["info", str(d)]) == 0
    assert NO_CHECKSUMS in capfd.readouterr().out
    # A run resumes from it (here on one rank), saying that only sizes were checked.
    report = launch(jobs.train_jobs, 1, [SAVED.replace(steps=5, checkpoint_dir=str(d))])[0][0]
    assert report["first_step"] == 4 and len(report["losses"]) == 1
    assert f"{d / 'step_00000004'}: {NO_CHECKSUMS}" in capfd.readouterr().err


@pytest.mark.parametrize("extra, saved", [([], []), (["--checkpoint-every", "1"], ["step_00000001"])])
def test_an_lr_that_overflows_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, extra, saved):
    # Adam at lr 1e20 moves every weight by about 1e20 in step 0 (still finite); step
    # 1's activations overflow and its loss is not finite.
    done = subprocess.run([sys.executable, "-m", "zerolearn.train", *TRAIN, "--steps", "3", "--lr", "1e20",
                           "--checkpoint-dir", str(tmp_path / "ck"), *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "rank 0: NonFiniteError: step 1: the global mean loss is" in done.stderr
    held = sorted(p.name for p in (tmp_path / "ck").iterdir()) if (tmp_path / "ck").exists() else []
    assert [n for n in held if n.startswith("step_")] == saved


def test_parameters_broken_by_an_update_are_never_saved():
    message = on_ranks(jobs.save_broken_parameters, 1)[0]
    assert message.startswith("NonFiniteError: step 3: its update made parameters NaN or inf"), message


# ----- one job per directory, full disks (issue 17) ---------------------------------------

def train_cli(*argv: str, script: str | None = None) -> subprocess.CompletedProcess:
    """``python -m zerolearn.train ARGV`` (or ``python -c SCRIPT ARGV``) in a real process."""
    head = ["-c", script] if script else ["-m", "zerolearn.train"]
    return subprocess.run([sys.executable, *head, *TRAIN, *argv], capture_output=True, text=True, timeout=120)


def lock_is_free(d: Path) -> bool:
    import filelock

    try:
        filelock.FileLock(str(d / ".lock")).acquire(timeout=0).lock.release()
    except filelock.Timeout:
        return False
    return True


def test_a_second_job_on_a_checkpoint_dir_exits_2_naming_it_and_leaves_its_files(tmp_path):
    import filelock

    d = tmp_path / "ck"
    (d / ".step_00000002.tmp").mkdir(parents=True)  # the first job's save in progress
    (d / ".step_00000002.tmp" / "rank_00000.pt.part").write_bytes(b"half")
    with filelock.FileLock(str(d / ".lock")):  # the first job, alive
        done = train_cli("--steps", "1", "--checkpoint-dir", str(d))
        assert done.returncode == 2, done.stderr
        assert (f"error: --checkpoint-dir {d}: another job is using this checkpoint directory (it holds the lock "
                f"{d / '.lock'})") in done.stderr
        assert "Traceback" not in done.stderr
        assert sorted(os.listdir(d)) == [".lock", ".step_00000002.tmp"]  # nothing trained, saved or removed
        assert (d / ".step_00000002.tmp" / "rank_00000.pt.part").read_bytes() == b"half"
        # A save outside the CLI (no lock of its own) leaves another job's leftovers alone too.
        on_ranks(jobs.train_jobs, 1, [SMALL.replace(steps=1, checkpoint_dir=str(d))])
        assert (d / ".step_00000002.tmp" / "rank_00000.pt.part").read_bytes() == b"half"
        assert (d / "step_00000001").is_dir()
    assert lock_is_free(d)


def test_stale_partial_saves_are_removed_when_the_lock_is_free_and_it_is_released_at_the_end(tmp_path):
    d = tmp_path / "ck"
    (d / ".step_00000007.tmp").mkdir(parents=True)  # a save of a job that crashed
    (d / ".step_00000007.tmp" / "rank_00000.pt.part").write_bytes(b"half")
    done = train_cli("--steps", "1", "--checkpoint-dir", str(d))
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(d)) == [".lock", "step_00000001"]
    assert lock_is_free(d)
    checkpoint.verify(str(d / "step_00000001"))


FULL_DISK = ("import errno, sys, torch\n"
             "from zerolearn import cli\n"
             "def full(obj, f, *args, **kwargs):\n"
             "    f.write(b'partial')\n"
             "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
             "torch.save = full\n"
             "sys.exit(cli.main(sys.argv[1:]))\n")


def test_a_full_disk_while_saving_is_a_runtime_failure_naming_rank_and_path(tmp_path):
    d = tmp_path / "ck"
    done = train_cli("--steps", "1", "--checkpoint-dir", str(d), script=FULL_DISK)
    assert done.returncode == 1, done.stderr
    assert (f"rank 0: CheckpointWriteError: checkpoint {d / 'step_00000001'} not written: rank 0: writing "
            f"{d / '.step_00000001.tmp' / 'rank_00000.pt'}: OSError: [Errno 28] No space left on device"
            ) in done.stderr
    assert "Traceback" not in done.stderr
    assert os.listdir(d) == [".lock"]  # the partial save removed
    assert lock_is_free(d)


def test_a_full_disk_while_writing_the_report_exits_1_naming_the_path(tmp_path):
    report = tmp_path / "run.json"
    report.symlink_to("/dev/full")  # every write: OSError ENOSPC
    done = train_cli("--steps", "1", "--report", str(report))
    assert done.returncode == 1, done.stderr
    assert f"rank 0: cannot write the report {report}: OSError: [Errno 28] No space left on device" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_resume_with_nothing_left_says_so_and_fewer_steps_than_the_checkpoint_exits_2(tmp_path):
    def run(steps: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zerolearn.train", *TRAIN, "--steps", steps,
                               "--checkpoint-dir", str(tmp_path / "ck")], capture_output=True, text=True, timeout=120)

    assert run("2").returncode == 0
    again = run("2")  # a finished run started again, as a restarted job would be
    assert again.returncode == 0, again.stderr
    assert "nothing left to train, the checkpoint is at step 2 = --steps" in again.stdout
    assert "nan" not in again.stdout
    fewer = run("1")
    assert fewer.returncode == 2
    message = f"--steps 1: the checkpoint in {tmp_path / 'ck'} is at step 2 already; allowed: --steps 2 or more"
    assert message in fewer.stderr
