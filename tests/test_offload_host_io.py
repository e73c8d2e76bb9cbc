"""Disk offload hands file I/O host memory only: device tensors cross through a host buffer.

On CUDA the stage-3 parameter shards live on the device; ``os.pwrite`` of their address
fails with ``OSError: Bad address``. Every byte the swapper writes or reads must come
from, or land in, host memory: here the staged path (the one CUDA tensors take) is forced
on CPU tensors and every tensor handed to the file calls is recorded.
"""

from __future__ import annotations

import pytest
import torch

import jobs
from jobs import on_ranks
from zerolearn import data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.engines import offload as off
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.quick


class IORecorder:
    """Wraps the swapper's two file calls; records (what, device, address, bytes) of each."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str, int, int]] = []
        pwrite, preadv = off._pwrite_host, off._preadv_host

        def write(fd, t, offset):
            self.calls.append(("write", t.device.type, t.data_ptr(), t.numel() * t.element_size()))
            return pwrite(fd, t, offset)

        def read(fd, t, offset, name):
            self.calls.append(("read", t.device.type, t.data_ptr(), t.numel() * t.element_size()))
            return preadv(fd, t, offset, name)

        monkeypatch.setattr(off, "_pwrite_host", write)
        monkeypatch.setattr(off, "_preadv_host", read)


def test_file_io_refuses_memory_that_is_not_the_hosts():
    with pytest.raises(ValueError, match="host memory; got a tensor on meta"):
        off._bytes_view(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="contiguous"):
        off._bytes_view(torch.zeros(4, 4).t())
    with pytest.raises(ConfigError, match="cap_bytes=0"):
        off.HostStaging(0)


def test_device_tensors_cross_through_the_staging_buffer_only(monkeypatch, tmp_path):
    io = IORecorder(monkeypatch)
    monkeypatch.setattr(off, "_needs_staging", lambda t: True)  # as every CUDA tensor does
    swapper = off.DiskSwapper(str(tmp_path), 0, "params")
    swapper.staging = off.HostStaging(cap_bytes=96)  # small: tensors cross in pieces
    a = torch.randn(100)
    b = torch.arange(37, dtype=torch.bfloat16)
    want = [a.clone(), b.clone()]
    swapper.store(0, [a, b])
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0  # released
    assert swapper.file_bytes() == 400 + 74
    swapper.load(0, [a, b])
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])
    staging = swapper.staging.buffer
    lo, hi = staging.data_ptr(), staging.data_ptr() + staging.numel()
    assert {c[0] for c in io.calls} == {"write", "read"}
    for what, device, address, nbytes in io.calls:
        assert device == "cpu", (what, device)
        assert lo <= address and address + nbytes <= hi, "file I/O saw memory other than the staging buffer"
    assert max(c[3] for c in io.calls) == 96 and len(io.calls) == 2 * (5 + 1)  # 400 B in 5 pieces, 74 B in 1
    assert swapper.stats()["bytes_written"] == swapper.stats()["bytes_read"] == 474
    swapper.close()
    assert swapper.staging.buffer is None


def test_host_tensors_are_read_and_written_in_place(monkeypatch, tmp_path):
    io = IORecorder(monkeypatch)
    swapper = off.DiskSwapper(str(tmp_path), 0)
    t = torch.randn(50)
    want = t.clone()
    swapper.store(3, [t])
    swapper.load(3, [t])
    assert torch.equal(t, want)
    assert [c[:2] for c in io.calls] == [("write", "cpu"), ("read", "cpu")]
    assert swapper.staging.buffer is None  # never needed
    swapper.close()


def stage3_disk_job(staged: bool, steps: int = 3) -> dict:
    """ZeRO-3 with ``offload="disk"`` for ``steps`` steps on this rank, the swappers' I/O
    recorded; ``staged``: every tensor takes the path of a CUDA tensor (the host buffer)."""
    import contextlib

    ctx = zdist.context()
    calls: list[tuple[str, str, bool]] = []
    pwrite, preadv, needs = off._pwrite_host, off._preadv_host, off._needs_staging
    staging_buffers: list[torch.Tensor] = []

    def inside_staging(t) -> bool:
        return any(s.data_ptr() <= t.data_ptr() < s.data_ptr() + s.numel() for s in staging_buffers)

    def write(fd, t, offset):
        calls.append(("write", t.device.type, inside_staging(t)))
        return pwrite(fd, t, offset)

    def read(fd, t, offset, name):
        calls.append(("read", t.device.type, inside_staging(t)))
        return preadv(fd, t, offset, name)

    take = off.HostStaging.take

    def take_recorded(self, nbytes):
        piece = take(self, nbytes)
        staging_buffers.append(self.buffer)
        return piece

    off._pwrite_host, off._preadv_host = write, read
    off.HostStaging.take = take_recorded
    if staged:
        off._needs_staging = lambda t: True  # as every CUDA tensor does
    losses = []
    try:
        with contextlib.ExitStack() as stack:
            engine = make_engine(3, jobs.small_gpt(), optimizer="adam", lr=1e-2, bucket_mb=0.01, offload="disk")
            stack.callback(engine.close)
            for step in range(steps):
                x, y = (data.rank_slice(v, ctx.rank, ctx.world_size) for v in jobs.global_batch(step))
                loss = jobs.gpt_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                losses.append(float(loss))
    finally:
        off._pwrite_host, off._preadv_host, off._needs_staging = pwrite, preadv, needs
        off.HostStaging.take = take
    return {"losses": losses, "calls": calls}


def test_stage3_on_disk_trains_the_same_with_every_shard_staged():
    plain = on_ranks(stage3_disk_job, 2, False)
    staged = on_ranks(stage3_disk_job, 2, True)
    for rank in range(2):
        assert staged[rank]["losses"] == plain[rank]["losses"]
        calls = staged[rank]["calls"]
        assert {c[0] for c in calls} == {"write", "read"}
        assert all(device == "cpu" and in_staging for _, device, in_staging in calls)
        assert all(device == "cpu" and not in_staging for _, device, in_staging in plain[rank]["calls"])
