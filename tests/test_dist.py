"""The runtime: launch, torchrun environment checks, backend choice."""

import pytest
import torch

import jobs
from zerolearn import dist as zdist
from zerolearn.dist import ConfigError, RankError, launch

pytestmark = pytest.mark.slow  # launch and teardown of process groups


@pytest.mark.slow  # 3 ranks
def test_launch_returns_each_ranks_result_in_rank_order():
    assert launch(jobs.whoami, 3) == [(0, 3), (1, 3), (2, 3)]


def test_launch_reraises_a_worker_exception_with_its_rank():
    with pytest.raises(RankError, match=r"rank 1 failed: ValueError: boom on purpose at rank 1") as info:
        launch(jobs.raise_on_rank, 2, 1)
    assert info.value.rank == 1


def test_launch_refuses_a_bad_world_size():
    with pytest.raises(ConfigError, match="world_size=0"):
        launch(jobs.whoami, 0)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"},
     "RANK=4 WORLD_SIZE=4"),
    ({"RANK": "a", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"},
     "must be integers"),
])
def test_torchrun_variables_missing_or_inconsistent_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        zdist.torchrun_env(env)


def test_torchrun_variables_absent_mean_standalone():
    assert zdist.torchrun_env({}) is None
    assert zdist.torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                               "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == (1, 2, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA messages")
@pytest.mark.parametrize("backend, device, message", [
    ("nccl", "auto", "--backend nccl: CUDA is not available"),
    ("auto", "cuda", "--device cuda: CUDA is not available"),
    ("mpi", "auto", "--backend 'mpi': allowed are auto, gloo, nccl"),
    ("auto", "tpu", "--device 'tpu': allowed are auto, cpu, cuda"),
])
def test_backend_and_device_without_cuda_are_refused(backend, device, message):
    with pytest.raises(ConfigError, match=message):
        zdist.resolve_backend_device(backend, device)


def test_auto_picks_gloo_on_cpu_and_nccl_on_cuda():
    expected = ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")
    assert zdist.resolve_backend_device("auto", "auto") == expected


def test_a_clean_teardown_returns_only_once_every_rank_has_left_its_group():
    # Where rank 0's process hosts the store (env:// with MASTER_PORT set by hand), rank 1 is
    # slow to leave (a loaded machine): rank 0 must not go on to exit while rank 1 still has its
    # process group. (Under launch the launcher hosts the store; the job makes its ranks behave
    # as rank 0 hosting it.)
    def leave():
        import gc
        import os
        import time

        import torch.distributed as dist

        from zerolearn import dist as zdist

        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")
        zdist._OWN_STORE = zdist.context().rank == 0
        left = {}
        if zdist.context().rank == 1:
            collect, destroy = gc.collect, dist.destroy_process_group

            def slow_collect(*args):
                time.sleep(1.5)
                return collect(*args)

            def timed_destroy(*args):
                destroy(*args)
                left["at"] = time.monotonic()

            gc.collect, dist.destroy_process_group = slow_collect, timed_destroy
        zdist.teardown()
        return time.monotonic(), left.get("at")

    (rank0_done, _), (_, rank1_left) = launch(leave, 2, timeout_s=120)
    assert rank1_left is not None and rank0_done >= rank1_left


def test_launch_hosts_the_store_so_no_rank_hosts_it():
    def who_hosts():
        import os

        from zerolearn import dist as zdist

        return zdist._OWN_STORE, os.environ.get("TORCHELASTIC_USE_AGENT_STORE")

    assert launch(who_hosts, 2, timeout_s=120) == [(False, "True"), (False, "True")]


def test_a_hosted_store_binds_a_port_the_os_picks_and_refuses_a_bad_timeout():
    a, b = zdist.host_store(5), zdist.host_store(5)
    assert a.port != b.port and a.port > 0
    env = zdist.hosted_store_env(a, 1, 2)
    assert env["MASTER_PORT"] == str(a.port) and env["RANK"] == "1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    with pytest.raises(ConfigError, match="timeout_s=0"):
        zdist.host_store(0)
