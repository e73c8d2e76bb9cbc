"""python -m zerolearn.launch: torchrun with the training CLI's exit codes."""

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import filelock
import pytest
import torch

from zerolearn import dist as zdist
from zerolearn.dist import RankError, free_port, launch

pytestmark = pytest.mark.slow  # torchrun and launch processes

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


@pytest.mark.slow  # torchrun
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


@pytest.mark.slow  # torchrun
def test_a_master_port_another_program_holds_is_named_and_does_not_hang():
    import socket
    import time

    def timed(rank: int, port: int) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        return train_as_rank(rank, port, "3"), time.monotonic() - start

    with socket.socket() as held:  # listens, accepts, never answers: not a torch store
        held.bind(("127.0.0.1", 0))
        held.listen(8)
        port = held.getsockname()[1]
        with ThreadPoolExecutor(max_workers=2) as pool:  # two processes, neither waits for the other
            (rank0, _), (rank1, waited) = pool.map(timed, (0, 1), (port, port))
        assert rank0.returncode == 2, rank0.stderr
        assert f"error: MASTER_PORT {port}: address already in use on 127.0.0.1" in rank0.stderr
        assert rank1.returncode == 1, rank1.stderr
        assert f"rank 1: joining the job's store at 127.0.0.1:{port} got no answer within --timeout 3 s" in rank1.stderr
        assert waited < 40  # torch's own client waits far longer
        assert "Traceback" not in rank0.stderr + rank1.stderr


# launch(fn, ...) with functions written where a reader writes them: in a notebook cell,
# a lambda, a closure, a function nested in another; they travel to the ranks by value.

def closure_over_a_local():
    base = torch.arange(3.0)
    return (lambda: base + zdist.context().rank), (), [torch.arange(3.0) + r for r in range(3)]


def a_lambda():
    return (lambda scale: zdist.context().rank * scale), (10,), [0, 10, 20]


def a_nested_function_returning_its_own_class():
    class Shard:  # defined in the function, like a class in a notebook cell
        def __init__(self, rank):
            self.rank = rank

        def __eq__(self, other):
            return isinstance(other, Shard) and other.rank == self.rank

    def make(world_size):
        return Shard(zdist.context().rank), world_size

    return make, (3,), [(Shard(r), 3) for r in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("case", [closure_over_a_local, a_lambda, a_nested_function_returning_its_own_class])
def test_launch_runs_functions_defined_in_place_on_3_ranks(case):
    fn, args, expected = case()
    results = launch(fn, 3, *args, timeout_s=120)
    assert len(results) == 3
    for got, want in zip(results, expected, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want)
        else:
            assert got == want


MAIN = """
import torch
from zerolearn.dist import context, launch


class Box:
    def __init__(self, value):
        self.value = value


def per_rank(scale):
    return Box(torch.full((2,), context().rank * scale))


if __name__ == "__main__":
    boxes = launch(per_rank, 2, 10.0, timeout_s=120)
    assert all(type(b) is Box for b in boxes), boxes  # the script's own class comes back
    print([b.value.tolist() for b in boxes])
"""


@pytest.mark.slow
def test_launch_runs_a_function_defined_in_a_main_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(MAIN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0.0, 0.0], [10.0, 10.0]]"


def test_a_rank_that_raises_in_a_lambda_is_named():
    with pytest.raises(RankError, match=r"rank 1 failed: ZeroDivisionError") as info:
        launch(lambda: 1 / (1 - zdist.context().rank), 2, timeout_s=120)
    assert info.value.rank == 1


def test_a_function_that_cannot_travel_is_refused_before_any_rank_starts():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="launch: cannot send .* to the ranks"):
        launch(lambda: lock.locked(), 2)


def test_ranks_that_never_return_are_cut_off_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"launch: ranks \[0, 1\] gave no result within 3 s"):
        launch(lambda: time.sleep(600), 2, timeout_s=3)
    assert time.monotonic() - start < 60  # killed, not waited for


# ----- the launcher commands of docs/USAGE.md, and bad launcher options -----------------

def usage_launch_commands() -> list[str]:
    """The ``python -m zerolearn.launch`` lines of docs/USAGE.md's training section, as written."""
    usage = open(os.path.join(os.path.dirname(__file__), "..", "docs", "USAGE.md")).read()
    section = usage.split("\n## Training runs and chapter scripts\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.split("  #")[0].strip() for block in section.split("```bash")[1:]
             for line in block.split("```")[0].splitlines()]
    return [line for line in lines if line.startswith("python -m zerolearn.launch")]


def test_the_usage_page_shows_the_standalone_form_and_the_form_with_no_rendezvous_option():
    commands = usage_launch_commands()
    assert any("--standalone" in c for c in commands), commands
    assert any(not re.search(r"--standalone|--master-port|--rdzv", c) for c in commands), commands


@pytest.mark.slow
@pytest.mark.parametrize("command", usage_launch_commands())
def test_the_usage_pages_launcher_commands_run_as_written(command, tmp_path):
    argv = shlex.split(command)
    assert argv[0] == "python"
    done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    stage = argv[argv.index("--stage") + 1]
    nproc = argv[argv.index("--nproc-per-node") + 1]
    assert re.search(rf"stage {stage}: loss \d+\.\d+ -> \d+\.\d+ over steps 0-\d+ on {nproc} rank\(s\)", done.stdout)
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: allowed are an integer from 1 to 65535, auto, cpu or gpu"),
    (["--nproc-per-node", "99999999999999999999"], "--nproc-per-node 99999999999999999999: allowed are"),
    (["--nnodes", "0"], "--nnodes 0: allowed are N or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "x"], "--nnodes x: allowed are N or MIN:MAX"),
    (["--max-restarts", "-1"], "--max-restarts -1: must be an integer >= 0"),
    (["--master-port", "70000"], "--master-port 70000: allowed are 1 to 65535"),
    (["--nproc-per-node", "2", "--", "--seed", "99999999999999999999"],
     "--seed 99999999999999999999: too large; allowed are up to 4294967295"),
    (["--nproc-per-node", "2", "--", "--report", "newdir/"], "--report newdir/: ends in a path separator"),
])
def test_bad_launcher_options_exit_2_before_any_worker_starts(args, message, capsys):
    from zerolearn import launch as launcher

    with pytest.raises(SystemExit) as info:
        launcher.main(args if "--" in args else [*args, "--", "--steps", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err


# ----- the launcher's exit code, whatever order the workers end in -----------------------

@pytest.mark.parametrize("codes, want", [
    ([2, 143], 2),  # the other worker answered torchrun's SIGTERM with 143 before it could exit 2 itself
    ([143, 2], 2),
    ([2, -15], 2),  # ... or died of it
    ([2, 2], 2),
    ([1, 143], 1),
    ([2, 1], 2),  # bad input on one worker; nothing else exits 2
    ([3, -9], 1),
    ([143, -15], 143),  # SIGTERM reached the workers themselves
    ([130], 130),
    ([130, 143], 1),
    ([-6, -15], 1),
])
def test_the_exit_code_is_the_failing_workers_not_the_stopped_ones(codes, want):
    from types import SimpleNamespace

    from zerolearn import launch as launcher

    assert launcher.exit_code({r: SimpleNamespace(exitcode=c) for r, c in enumerate(codes)}) == want


# Rank 0 exits 2 after 0.2 s; rank 1 answers SIGTERM with 143 (as zerolearn.train does) and exits 2 itself
# after a delay: before torchrun stops it, while it does, or long after (it is stopped first).
WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
time.sleep(0.2 if os.environ["RANK"] == "0" else float(sys.argv[1]))
sys.exit(2)
"""

RACE = """
import sys
from torch.distributed import run as torchrun
from zerolearn import launch as launcher
from zerolearn.ranks import free_port

codes = []
for delay in sys.argv[1:]:
    args, _ = launcher._parse(["--nproc-per-node", "2", "--master-port", str(free_port())], [])
    config, cmd, _ = torchrun.config_from_args(args)
    codes.append(launcher.run(config, cmd, ["-c", WORKER, delay]))
print(codes)
"""


def test_a_workers_exit_2_is_the_launchers_whichever_worker_ends_first():
    delays = ["0", "0.15", "0.25", "0.4", "2"]
    done = subprocess.run([sys.executable, "-c", f"WORKER = {WORKER!r}\n{RACE}", *delays], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str([2] * len(delays)), done.stdout + done.stderr[-2000:]


def test_sigterm_during_rendezvous_is_named_in_one_line_and_exits_143():
    import signal
    import socket

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "zerolearn.launch", "--nnodes", "2", "--nproc-per-node", "1",
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--",
                             "--steps", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the launcher hosts the rendezvous store: it waits for node 2 now
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the launcher never opened its rendezvous store")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    named = [line for line in err.splitlines() if "stopped by SIGTERM during rendezvous" in line]
    assert len(named) == 1 and named[0].startswith("python -m zerolearn.launch: "), err
    assert "Traceback" not in err
