"""launch on a busy machine: launches started side by side all start, and ranks end quietly.

Each launch's store is bound by the launching process on a port the operating system
picks as it binds (no port found free and taken by someone else before rank 0 listens),
and it outlives every rank, so no rank's stderr (captured at the file descriptor, where
c10d's C++ warnings go) shows a store error at a normal end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # launches side by side and in a row

SCRIPT = textwrap.dedent('''
    import sys
    from zerolearn.dist import launch
    from zerolearn.live import Ranks

    def job(x):
        import torch
        import torch.distributed as dist
        t = torch.ones(4) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return float(t.sum()) * x

    if __name__ == "__main__":
        mode, times, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        want = [4.0 * world * (world + 1) / 2] * world
        for _ in range(times):
            if mode == "launch":
                got = launch(job, world, 1.0, timeout_s=600)
            else:
                with Ranks(world, timeout_s=600) as ranks:
                    got = ranks.call(job, 1.0)
            assert got == want, got
        print("ok", times)
''')


def run_script(tmp_path, mode: str, times: int, world: int) -> subprocess.Popen:
    path = tmp_path / "side_by_side.py"
    if not path.exists():
        path.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(path), mode, str(times), str(world)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_eight_launches_started_at_once_all_finish(tmp_path):
    procs = [run_script(tmp_path, "launch", 1, 2) for _ in range(8)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip() == "ok 1", err[-2000:]
        assert err == "", err[-2000:]


@pytest.mark.slow
def test_eight_launches_in_a_row_end_with_nothing_on_stderr(tmp_path):
    # The ranks inherit the script's file descriptor 2: c10d's C++ stack traces would land here.
    p = run_script(tmp_path, "launch", 8, 3)
    out, err = p.communicate(timeout=1800)
    assert p.returncode == 0 and out.strip() == "ok 8", err[-2000:]
    assert err == "", err[-3000:]


@pytest.mark.slow
def test_live_ranks_closed_three_times_leave_nothing_on_stderr(tmp_path):
    p = run_script(tmp_path, "live", 3, 3)
    out, err = p.communicate(timeout=1800)
    assert p.returncode == 0 and out.strip() == "ok 3", err[-2000:]
    assert err == "", err[-3000:]
