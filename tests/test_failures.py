"""Failures that fail loudly, and runs that survive them: a killed rank restarted by
torchrun resumes exactly, disagreeing ranks are named instead of hanging, dead and stuck
ranks are named, and an fp16 overflow on one rank is skipped by all."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import jobs
from jobs import on_ranks
from zerolearn import checkpoint
from zerolearn.config import TrainConfig
from zerolearn.dist import RankError, free_port, launch
from zerolearn.train import train

pytestmark = pytest.mark.slow  # torchrun restarts, killed and stuck ranks

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
RUN = TrainConfig(steps=6, global_batch_size=12, seq_len=16, d_model=32, n_head=2, bucket_mb=0.01, quiet=True)


def torchrun(*args: str, nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    # torchrun's own defaults: restarts share its rendezvous store (zerolearn.dist.init
    # keeps each attempt's keys apart; see zerolearn.train's docstring).
    return subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_killed_rank_restarts_and_finishes_exactly_like_an_uninterrupted_run(tmp_path):
    # Rank 1 SIGKILLs itself in step 3 (after the step-2 checkpoint); torchrun restarts
    # both ranks, which resume at step 2 and run steps 2-5. fp32 on gloo is
    # deterministic, so every loss and every parameter and moment must equal, bit for
    # bit, those of the run that was never interrupted: no step lost, none applied twice.
    common = RUN.replace(stage=3, checkpoint_dir=str(tmp_path / "whole"), checkpoint_every=2)
    whole = on_ranks(train, 2, common)[0]
    killed = common.replace(checkpoint_dir=str(tmp_path / "killed"), report=str(tmp_path / "killed.json"),
                            fail_at_step=3, fail_rank=1)
    done = torchrun("--max-restarts=1", "-m", "zerolearn.train", *killed.to_argv())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: failing on purpose in step 3 (kill)" in done.stderr
    report = json.loads((tmp_path / "killed.json").read_text())
    assert report["first_step"] == 2 and report["world_size"] == 2
    assert report["losses"] == whole["losses"][2:]
    assert whole["first_step"] == 0 and len(whole["losses"]) == 6
    for key in ("master", "exp_avg", "exp_avg_sq"):
        a = checkpoint.read_full(str(tmp_path / "whole"), key)
        b = checkpoint.read_full(str(tmp_path / "killed"), key)
        assert all(torch.equal(a[n], b[n]) for n in a), key
    assert checkpoint.manifest(str(tmp_path / "killed")).step == 6


def test_resumed_run_with_nothing_left_and_resume_with_other_data(tmp_path):
    ck = RUN.replace(checkpoint_dir=str(tmp_path / "ck"))
    first, again, other = on_ranks(jobs.train_jobs, 1, [ck, ck, ck.replace(seed=1)])[0]
    assert first["first_step"] == 0 and len(first["losses"]) == 6
    assert again["first_step"] == 6 and again["losses"] == []
    assert "holds a checkpoint of a run with other options: this run has --seed 1 (the checkpoint's run: 0)" in other


def test_a_rank_dependent_branch_is_named_instead_of_hanging(monkeypatch):
    # Rank 1 skips block 1 under ZeRO-3. Thanks to prefetching, both ranks would still
    # issue the same gathers in the same order, and the step would complete with wrong
    # gradients. ZeRO-3's ranks agree on each unit before its forward (and debug mode,
    # on here, on every collective): the first unit that differs stops both ranks, and
    # the message says who ran what.
    monkeypatch.setenv("ZEROLEARN_DEBUG_COLLECTIVES", "1")
    with pytest.raises(RankError, match="ranks are about to run different units") as info:
        launch(jobs.skip_unit_forward, 2)
    message = str(info.value)
    assert re.search(r"rank 0 runs unit \d+: blocks\.1, Block; rank 1 runs unit \d+: head, Head", message), message


def test_debug_mode_changes_no_number_and_no_ledger_entry(two_ranks):
    out = two_ranks[0][-1]
    assert out["checks"] > 0  # fingerprints were really exchanged
    for plain, debug in zip(out["plain"], out["debug"], strict=True):
        assert debug["config"]["debug_collectives"] and not plain["config"]["debug_collectives"]
        assert debug["losses"] == plain["losses"]
        assert [r["comm"] for r in debug["ranks"]] == [r["comm"] for r in plain["ranks"]]


def test_a_dead_rank_is_named_by_the_others(monkeypatch):
    # Rank 1 exits (code 0, so the launcher sees nothing wrong); rank 0's next collective
    # fails on the closed connection and its error names rank 1.
    monkeypatch.setenv("ZEROLEARN_REPORT_GRACE", "1")
    with pytest.raises(RankError) as info:
        launch(jobs.dead_rank, 2)
    assert info.value.rank == 0
    assert "CollectiveError" in str(info.value)
    assert "rank 1 posted nothing within 1 s: dead or stuck" in str(info.value)


def test_a_stuck_rank_makes_the_others_fail_within_the_timeout_naming_it(monkeypatch):
    # Rank 1 stops responding in step 2; the others hit the 3 s process-group timeout
    # and exit 1 with a message naming rank 1, instead of hanging forever.
    monkeypatch.setenv("ZEROLEARN_REPORT_GRACE", "1")
    t0 = time.monotonic()
    stuck = RUN.replace(stage=2, timeout=3, fail_at_step=2, fail_rank=1, fail_mode="hang")
    done = torchrun("-m", "zerolearn.train", *stuck.to_argv(), nproc=3)
    elapsed = time.monotonic() - t0
    assert done.returncode != 0
    for rank in (0, 2):
        line = next(x for x in done.stderr.splitlines() if x.startswith(f"rank {rank}: CollectiveError"))
        assert "rank 1 posted nothing within" in line and "dead or stuck" in line, line
    assert elapsed < 60


@pytest.fixture(scope="module")
def two_ranks() -> list[list]:
    """One 2-rank launch for the fp16 and debug-mode tests (spawning is the slow part):
    fp16 runs of every stage with inf on rank 1 in step 2 and nan on rank 0 in step 4,
    then the train CLI without and with --debug-collectives."""
    inject = {2: (1, float("inf")), 4: (0, float("nan"))}
    calls = [("fp16_overflow", dict(stage=s, steps=7, inject=inject)) for s in range(4)]
    calls.append(("debug_mode_is_transparent", dict(config=RUN.replace(steps=2))))
    return on_ranks(jobs.several, 2, calls)


@pytest.mark.parametrize("stage", range(4))
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(two_ranks, stage):
    # Expected from the rule alone: scale 256 doubles after 2 clean steps and halves
    # (with the step skipped) on any inf or nan, wherever it appears.
    expected_flags = [True, True, False, True, False, True, True]
    expected_scales, scale, clean = [], 256.0, 0
    for ok in expected_flags:
        if ok:
            clean += 1
            scale = scale * 2 if clean % 2 == 0 else scale
        else:
            clean, scale = 0, scale / 2
        expected_scales.append(scale)
    ranks = [r[stage] for r in two_ranks]
    assert len(ranks) == 2 and ranks[0]["params"]
    for run in ranks:
        assert run["flags"] == expected_flags
        assert run["scales"] == expected_scales
        assert run["skipped"] == 2
        # A skipped step changes no parameter; a taken one changes some.
        assert run["unchanged"] == [not ok for ok in expected_flags]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
        assert torch.isfinite(value).all(), name


# ----- Ctrl-C (issue 17) ------------------------------------------------------------------

def interrupt_when_training(procs: list[subprocess.Popen], d, timeout: float = 60,
                            sig: int = signal.SIGINT) -> list[tuple[int, str]]:
    """Send ``sig`` to every process once the first checkpoint under ``d`` exists (training
    is under way, the lock held); (exit code, stderr) of each."""
    deadline = time.monotonic() + timeout
    while not (d.is_dir() and any(n.startswith("step_") for n in os.listdir(d))):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(sig)
    errs = [p.communicate(timeout=60)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


CTRL_C = [sys.executable, "-m", "zerolearn.train", *RUN.replace(steps=1000, checkpoint_keep=1).to_argv(),
          "--checkpoint-every", "1"]  # with --checkpoint-dir, added per test
LINE = re.compile(r"interrupted \(Ctrl-C\) at step (\d+); last checkpoint: \S+/step_\d{8}\n")


def test_ctrl_c_stops_with_one_line_and_exit_code_130(tmp_path):
    d = tmp_path / "ck"
    proc = subprocess.Popen([*CTRL_C, "--checkpoint-dir", str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        [(code, err)] = interrupt_when_training([proc], d)
    finally:
        proc.kill()
    assert code == 130, err
    assert LINE.fullmatch(err), err  # one line, no traceback
    assert int(LINE.fullmatch(err).group(1)) < 1000  # the step running (or saving) when Ctrl-C came
    import filelock

    filelock.FileLock(str(d / ".lock")).acquire(timeout=0).lock.release()  # released


def test_ctrl_c_on_two_ranks_exits_130_on_each_and_rank_0_says_so(tmp_path):
    # Two ranks with torchrun's variables (as torchrun starts them), each sent SIGINT as
    # a terminal's Ctrl-C does: rank 0 prints the line, rank 1 nothing, both exit 130.
    d, port = tmp_path / "ck", str(free_port())
    procs = [subprocess.Popen([*CTRL_C, "--checkpoint-dir", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                              "ZEROLEARN_REPORT_GRACE": "1"})
             for r in range(2)]
    try:
        (code0, err0), (code1, err1) = interrupt_when_training(procs, d)
    finally:
        for p in procs:
            p.kill()
    assert (code0, code1) == (130, 130), (err0, err1)
    assert LINE.fullmatch(err0), err0
    assert err1 == ""


# ----- SIGTERM (a scheduler's or kill's) ----------------------------------------------------

TERM_LINE = re.compile(r"terminated \(SIGTERM\) at step (\d+); last checkpoint: (\S+/step_(\d{8}))")


@pytest.mark.parametrize("how", ["train", "launch"])
def test_sigterm_stops_with_one_line_naming_it_and_the_last_checkpoint_and_exit_code_143(tmp_path, how):
    # To python -m zerolearn.train, or to python -m zerolearn.launch (which passes it on
    # to its 2 workers): exit 143, no traceback, one line from rank 0 naming the signal,
    # the step and the newest complete checkpoint, from which a run can resume.
    d = tmp_path / "ck"
    options = [*RUN.replace(steps=1000, checkpoint_keep=1).to_argv(), "--checkpoint-every", "1",
               "--checkpoint-dir", str(d)]
    head = [sys.executable, "-m", "zerolearn.launch", "--nproc-per-node", "2", "--"] if how == "launch" else \
        [sys.executable, "-m", "zerolearn.train"]
    proc = subprocess.Popen([*head, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        [(code, err)] = interrupt_when_training([proc], d, sig=signal.SIGTERM)
    finally:
        proc.kill()
    assert code == 143, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "SIGTERM" in line or "terminated" in line]
    assert len(lines) == 1 and TERM_LINE.fullmatch(lines[0]), err
    step, last, saved = TERM_LINE.fullmatch(lines[0]).groups()
    assert os.path.isdir(last) and int(saved) <= int(step) + 1
    checkpoint.verify(last)
