"""Persistent ranks (zerolearn.live): state kept between calls, labelled output, failures
named by rank and line, hangs cut off at the deadline, the %%ranks magic."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from zerolearn import live
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.slow  # persistent ranks started and stopped

TIMEOUT_S = 5.0  # every call here takes well under a second; a hang is cut off after this


@pytest.fixture(scope="module")
def pool():
    ranks = live.start(2, timeout_s=TIMEOUT_S)
    yield ranks
    live.stop()


def test_a_tensor_built_in_one_call_is_reduce_scattered_in_the_next_and_pulled_in_a_third(pool):
    pool.run("x = torch.arange(6.0) * (rank + 1)")
    pool.run("shard = torch.empty(3)\ncomm.reduce_scatter(shard, x);")
    shards = pool.pull("shard")
    total = sum(torch.arange(6.0) * (r + 1) for r in range(2))
    torch.testing.assert_close(torch.cat(shards), total)


def test_output_is_labelled_by_rank_and_a_last_expression_is_shown(pool):
    outputs = pool.run("print('hello from', rank)\nrank * 10")
    assert outputs == ["hello from 0\n0\n", "hello from 1\n10\n"]
    assert repr(outputs) == "[rank 0] hello from 0\n[rank 0] 0\n[rank 1] hello from 1\n[rank 1] 10"


def test_push_and_call_move_values_and_notebook_functions(pool):
    pool.push(scale=torch.tensor(3.0))
    offset = 1
    assert pool.call(lambda a: a + offset, 2) == [3, 3]
    assert pool.run("float(scale * rank)") == ["0.0\n", "3.0\n"]


def test_a_raising_rank_is_named_with_its_line_and_the_others_output_is_kept(pool):
    with pytest.raises(live.CellError, match=r"rank 1 failed at line 3 of the cell:") as info:
        pool.run("print('before', rank)\nif rank == 1:\n    1 / 0\nprint('after', rank)\nseen = rank")
    message = str(info.value)
    assert "ZeroDivisionError: division by zero" in message and "    1 / 0" in message
    assert "[rank 0] after 0" in message and "live.py" not in message
    assert info.value.outputs == ["before 0\nafter 0\n", "before 1\n"]
    assert not info.value.restarted  # every rank finished: the group and the variables are kept
    assert pool.run("print(x.sum().item(), globals().get('seen'))") == ["15.0 0\n", "30.0 None\n"]


def test_a_syntax_error_is_raised_before_any_rank_runs(pool):
    with pytest.raises(SyntaxError):
        pool.run("x = = 1")


def test_a_collective_only_one_rank_calls_is_cut_off_and_the_ranks_restart(pool):
    start = time.monotonic()
    with pytest.raises(live.CellError, match=r"rank 0 did not finish within 5 s") as info:
        pool.run("print('waiting', rank)\nif rank == 0:\n    dist.all_reduce(torch.ones(1))")
    assert time.monotonic() - start < TIMEOUT_S + 60  # the deadline, then a restart
    assert info.value.unfinished == [0] and info.value.restarted
    assert "every variable is lost" in str(info.value) and "[rank 0] waiting 0" in str(info.value)
    assert pool.run("print(dist.get_world_size(), rank)") == ["2 0\n", "2 1\n"]
    with pytest.raises(live.CellError, match="name 'x' is not defined on rank 0"):
        pool.pull("x")


def test_restart_clears_the_variables_and_ends_the_old_processes(pool):
    pool.push(kept=1)
    old = list(pool._procs)
    pool.restart()
    assert not any(p.is_alive() for p in old)
    with pytest.raises(live.CellError, match="name 'kept' is not defined"):
        pool.pull("kept")


@pytest.mark.slow
def test_a_rank_that_dies_is_named_and_the_ranks_restart(pool):
    with pytest.raises(live.CellError, match=r"rank 1 failed:\n    process exited with code 3") as info:
        pool.run("import os\nif rank == 1:\n    os._exit(3)")
    assert info.value.restarted and pool.running
    pool._procs[0].kill()  # between calls, as the OS might
    pool._procs[0].join()
    with pytest.raises(live.CellError, match=r"rank 0 failed:\n    process exited with code -9 since the last call"):
        pool.run("print(rank)")
    assert pool.run("rank") == ["0\n", "1\n"]


@pytest.fixture(scope="module")
def shell(pool):
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    ip.run_line_magic("load_ext", "zerolearn.live")
    yield ip
    InteractiveShell.clear_instance()


def test_the_ranks_magic_runs_a_cell_on_the_current_ranks(shell, pool, capsys):
    shell.run_cell_magic("ranks", "2", "y = torch.ones(2) * rank\nprint('y', y.tolist())\ny.sum()")
    assert live.current() is pool  # the same size: the same ranks
    assert capsys.readouterr().out == "[rank 0] y [0.0, 0.0]\n[rank 0] tensor(0.)\n[rank 1] y [1.0, 1.0]\n" \
                                      "[rank 1] tensor(2.)\n"
    shell.run_line_magic("ranks", "status")
    assert "Ranks(2, backend='gloo', timeout_s=5): running" in capsys.readouterr().out


def test_a_failing_cell_shows_the_ranks_error_without_our_frames(shell, capsys):
    result = shell.run_cell("%%ranks\nz = 1\nif rank == 0:\n    raise ValueError('only rank 0')")
    assert isinstance(result.error_in_exec, live.CellError)
    shown = capsys.readouterr().out
    assert "rank 0 failed at line 3 of the cell:" in shown and "ValueError: only rank 0" in shown
    assert "live.py" not in shown and "interactiveshell" not in shown


def test_the_magic_refuses_bad_arguments(shell):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="%%ranks two: allowed are N"):
        shell.run_cell_magic("ranks", "two", "pass")
    with pytest.raises(UsageError, match="%ranks reboot: allowed are N"):
        shell.run_line_magic("ranks", "reboot")


@pytest.mark.parametrize("make, message", [
    (lambda: live.Ranks(0), "world_size 0: must be an integer >= 1"),
    (lambda: live.Ranks(2, backend="mpi"), "backend 'mpi': allowed are gloo, nccl"),
    (lambda: live.Ranks(2, timeout_s=0), "timeout_s 0: must be a finite number > 0"),
    (lambda: live.start(-1), "world_size -1"),
])
def test_bad_input_is_refused_before_anything_starts(pool, make, message):
    with pytest.raises(ConfigError, match=message):
        make()
    assert live.current() is pool  # a refused start() stops nothing


def test_more_nccl_ranks_than_gpus_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="world_size=2 NCCL ranks need as many GPUs; this machine has 1"):
        live.Ranks(2, backend="nccl")


CTRL_C = """
import os, signal, sys, threading, time
from zerolearn import live

if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt here, as in a Jupyter kernel (a process started as a
    # shell's background job, a test suite run with "&" say, starts with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pool = live.Ranks(2, timeout_s=float(sys.argv[2]))
    pool.run("pass")
    old = list(pool._procs)
    if sys.argv[1] == "process":  # the signal as Ctrl-C sends it: to the process
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:  # to one other thread of the process, which the OS may choose
        threading.Timer(1.0, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        pool.run("import time\\ntime.sleep(30)")
        print("no interrupt")
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - t0:.1f} s")
    print("old ranks alive:", any(p.is_alive() for p in old))
    print("fresh ranks answer:", pool.run("rank") == ["0\\n", "1\\n"])
    pool.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("to", ["process", "thread"])
def test_ctrl_c_while_waiting_stops_the_ranks_at_once_and_the_next_call_starts_fresh_ones(tmp_path, to):
    # In a process of its own, with Python's own SIGINT handler: how the test suite was
    # started (a background job ignores SIGINT) must not decide the outcome.
    # "thread": the OS may hand SIGINT to any thread of a process (a kernel has several),
    # and then no wait in the main thread is interrupted; the wait wakes often enough to see it.
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(CTRL_C))
    done = subprocess.run([sys.executable, str(script), to, "20"], capture_output=True, text=True, timeout=180)
    lines = done.stdout.splitlines()
    waited = next((float(x.split()[2]) for x in lines if x.startswith("KeyboardInterrupt after")), None)
    assert waited is not None and waited < 5, done.stdout + done.stderr[-2000:]
    assert "old ranks alive: False" in lines and "fresh ranks answer: True" in lines, done.stdout


SCRIPT = """
import os, signal, sys
from zerolearn import live

if __name__ == "__main__":
    pool = live.Ranks(2)
    print(*pool.call(os.getpid), flush=True)
    if sys.argv[1] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exits", "killed"])
def test_no_rank_outlives_the_kernel(tmp_path, end):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, str(script), end], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2, done.stderr
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_call_until_ends_when_one_rank_decides_and_kills_the_rank_still_waiting(pool):
    def verdict_or_wait():
        import time

        from zerolearn import dist as zdist

        if zdist.context().rank == 0:
            return "verdict"
        time.sleep(600)  # a peer waiting for rank 0 in a collective, say

    start = time.monotonic()
    results, failed, cut = pool.call_until(lambda r: r == "verdict", verdict_or_wait, grace_s=0.5)
    assert results == {0: "verdict"} and failed == {} and cut == [1]
    assert time.monotonic() - start < TIMEOUT_S  # the grace, not the pool's deadline
    assert pool.call(lambda: 7) == [7, 7]  # fresh ranks answer the next call
