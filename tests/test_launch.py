"""python -m zerolearn.launch: torchrun with the training CLI's exit codes."""

import subprocess
import sys

import filelock

from zerolearn.dist import free_port

TINY = ["--steps", "1", "--global-batch-size", "4", "--seq-len", "16", "--n-layer", "1", "--d-model", "32",
        "--n-head", "2", "--quiet"]


def launch_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerolearn.launch", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bad_input_exits_2_before_any_worker_starts():
    done = launch_cli("--", "--n-head", "0")
    assert done.returncode == 2
    assert "error: --n-head 0: must be an integer >= 1" in done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def test_input_only_the_workers_can_refuse_exits_2_too(tmp_path):
    # Another job holds the checkpoint folder: only a running rank can find out, and
    # plain torchrun would turn the workers' exit 2 into 1.
    d = tmp_path / "ck"
    d.mkdir()
    with filelock.FileLock(str(d / ".lock")):
        done = launch_cli("--", *TINY, "--checkpoint-dir", str(d))
    assert done.returncode == 2, done.stderr
    assert "another job is using this checkpoint directory" in done.stderr


def test_a_good_run_exits_0():
    done = launch_cli("--", *TINY)
    assert done.returncode == 0, done.stderr
    assert "stage 0: loss" in done.stdout


def train_as_rank(rank: int, port: int, timeout: str) -> subprocess.CompletedProcess:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
    import os

    return subprocess.run([sys.executable, "-m", "zerolearn.train", "--timeout", timeout, *TINY],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_a_master_port_another_program_holds_is_named_and_does_not_hang():
    import socket
    import time

    with socket.socket() as held:  # listens, accepts, never answers: not a torch store
        held.bind(("127.0.0.1", 0))
        held.listen(8)
        port = held.getsockname()[1]
        rank0 = train_as_rank(0, port, "3")
        assert rank0.returncode == 2, rank0.stderr
        assert f"error: MASTER_PORT {port}: address already in use on 127.0.0.1" in rank0.stderr
        start = time.monotonic()
        rank1 = train_as_rank(1, port, "3")
        assert rank1.returncode == 1, rank1.stderr
        assert f"rank 1: joining the job's store at 127.0.0.1:{port} got no answer within --timeout 3 s" in rank1.stderr
        assert time.monotonic() - start < 40  # torch's own client waits far longer
        assert "Traceback" not in rank0.stderr + rank1.stderr
