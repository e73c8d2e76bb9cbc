"""Offload: the optimizer's step on the host (ZeRO-Offload) and its states on disk (ZeRO-Infinity).

ZeRO-Offload (Ren et al., USENIX ATC 2021, arXiv 2101.06840) runs on top of ZeRO-2: the 2-byte working parameters stay
on the device, where forward and backward run; the fp32 master, moments and gradient shard live in host memory (pinned
on CUDA), where torch's optimizer steps, and the stage's ``_publish`` copies the master back (synchronously). At stages
2-3 each reduced gradient shard moves to the host as its reduction finishes; at stage 1 the full gradient stays on the
device (P_os does not partition gradients). On a CPU-only run the offloaded tensors are still tensors of their own.

``offload="disk"`` (ZeRO-Infinity, Rajbhandari et al., SC'21, arXiv 2104.07857) also keeps each bucket's optimizer
states, and at stage 3 the working parameter shards (Sec 5), in files (:class:`DiskSwapper`). Unlike ZeRO-Infinity and
DeepSpeed's NVMe path, reads are synchronous (no prefetch under compute) and not pipelined with the step, and the fp32
gradient shard stays in host memory (4 Psi / Nd bytes per rank). ``dpu=True``: :class:`DelayedUpdate`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines import optim
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import category, location, retag

OFFLOADS = ("cpu", "disk")
"""Where ``offload=`` may put the optimizer states: host memory, or files on disk."""


def check_options(stage: int, offload: str | None, offload_dir: str | None, dpu: bool) -> None:
    """Refuse bad offload options before any work or collective; create and probe ``offload_dir``.

    Raises:
        ConfigError: ``offload`` not None, "cpu" or "disk"; offload at a stage other than 1-3; ``dpu`` not a bool, or
            True without offload; ``offload_dir`` without ``offload="disk"``, or not writable.
    """
    if offload is not None and (not isinstance(offload, str) or offload not in OFFLOADS):
        raise ConfigError(f"--offload {offload!r}: allowed are None (no offload), 'cpu', 'disk'")
    if offload is not None and stage not in (1, 2, 3):
        raise ConfigError(f"--offload {offload!r} at stage {stage}: allowed at stages 1, 2, 3 only (ZeRO-Offload "
                          "moves the partitioned optimizer states; stage 0 partitions nothing)")
    if not isinstance(dpu, bool):
        raise ConfigError(f"--dpu {dpu!r}: allowed are True, False")
    if dpu and offload is None:
        raise ConfigError("--dpu needs --offload cpu or --offload disk (the delayed update overlaps the host's "
                          "optimizer step with the next forward and backward)")
    if offload_dir is not None and offload != "disk":
        raise ConfigError(f"--offload-dir {offload_dir!r} needs --offload disk (got --offload {offload!r})")
    if offload_dir is not None:
        check_writable_dir(offload_dir)


def check_writable_dir(path: str) -> None:
    """Create folder ``path`` if missing and write a temporary file in it (permission bits alone do not tell).

    Raises:
        ConfigError: naming ``path`` and the reason, if either fails.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(f"--offload-dir {path!r}: give a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(f"--offload-dir {path}: not a writable folder ({e}); allowed: a folder this "
                          "process can create and write") from None


def _release(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _restore(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous host tensor ``t``, writable, for ``os.preadv`` and ``os.pwrite`` (ValueError
    otherwise). Through ctypes: sharing with numpy would make the storage non-resizable for good."""
    if t.device.type != "cpu":
        raise ValueError(f"file I/O needs host memory; got a tensor on {t.device} (stage it through a host "
                         "buffer: DiskSwapper does)")
    if not t.is_contiguous():
        raise ValueError(f"file I/O needs a contiguous tensor; got strides {t.stride()} for shape {tuple(t.shape)}")
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _pwrite_host(fd: int, t: torch.Tensor, offset: int) -> int:
    """Write host tensor ``t`` to file ``fd`` at byte ``offset``; the bytes written."""
    view, done = _bytes_view(t), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _preadv_host(fd: int, t: torch.Tensor, offset: int, name: str) -> int:
    """Fill host tensor ``t`` from file ``fd`` at byte ``offset``; the bytes read (OSError if the file ends first)."""
    view, done = _bytes_view(t), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"offload file {name} ends at byte {offset + done}; expected {offset + len(view)}")
        done += got
    return done


STAGING_MB = 32.0
"""Size cap (MiB) of the host buffer through which device tensors cross to and from files."""


def _needs_staging(t: torch.Tensor) -> bool:
    """Whether ``t`` is not in host memory (a CUDA tensor), so file I/O must go through a host buffer."""
    return t.device.type != "cpu"


class HostStaging:
    """One reused host buffer (pinned with CUDA) through which device tensors cross to and from files, grown on use up
    to ``cap_bytes`` bytes (a larger tensor crosses in pieces). Copies are synchronous.

    Raises:
        ConfigError: ``cap_bytes`` not an integer >= 1.
    """

    def __init__(self, cap_bytes: int = int(STAGING_MB * 2**20)):
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 1:
            raise ConfigError(f"staging cap_bytes={cap_bytes!r}: must be an integer >= 1")
        self.cap = cap_bytes
        self.buffer: torch.Tensor | None = None  # uint8, host

    def take(self, nbytes: int) -> torch.Tensor:
        """The first ``min(nbytes, cap)`` bytes of the buffer, as a uint8 host tensor."""
        n = min(nbytes, self.cap)
        if self.buffer is None or self.buffer.numel() < n:
            self.buffer = None  # the old one goes before the larger one comes
            with category("temporary"), location("host"):
                self.buffer = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self.buffer[:n]

    def write(self, fd: int, t: torch.Tensor, offset: int) -> int:
        """Write contiguous device tensor ``t`` to file ``fd`` at byte ``offset``; the bytes written."""
        flat, done = t.reshape(-1).view(torch.uint8), 0
        while done < flat.numel():
            piece = self.take(flat.numel() - done)
            piece.copy_(flat[done:done + piece.numel()])  # device -> host, synchronous
            done += _pwrite_host(fd, piece, offset + done)
        return done

    def read(self, fd: int, t: torch.Tensor, offset: int, name: str) -> int:
        """Fill contiguous device tensor ``t`` from file ``fd`` at byte ``offset``; the bytes read.

        Raises:
            OSError: the file ends before ``t`` is full.
        """
        flat, done = t.reshape(-1).view(torch.uint8), 0
        while done < flat.numel():
            piece = self.take(flat.numel() - done)
            got = _preadv_host(fd, piece, offset + done, name)
            flat[done:done + got].copy_(piece[:got])  # host -> device, synchronous
            done += got
        return done

    def release(self) -> None:
        """Give the buffer's memory back (the next use allocates it again)."""
        self.buffer = None


class DiskSwapper:
    """Each bucket's tensors, back to back, in a file of their own (device tensors through :class:`HostStaging`): the
    fp32 master, then the per-element optimizer states in key order, or stage 3's parameter shards. Between reads a
    tensor's storage is 0 bytes. The files, in a sub-folder ``zerolearn-offload-{what}-rank{rank}-*`` of ``directory``
    (None: a temporary folder) that :meth:`close` or garbage collection removes, go through the page cache: the
    bandwidth counted is the file path's.
    """

    def __init__(self, directory: str | None, rank: int, what: str = "states"):
        self.dir = tempfile.mkdtemp(prefix=f"zerolearn-offload-{what}-rank{rank}-", dir=directory)
        self.fds: dict[int, int] = {}
        self.staging = HostStaging()
        self.reset_stats()
        self._close = weakref.finalize(self, _remove, self.fds, self.dir)

    def reset_stats(self) -> None:
        """Start counting bytes and seconds afresh."""
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = 0.0

    def _fd(self, i: int) -> int:
        if i not in self.fds:
            self.fds[i] = os.open(self._name(i), os.O_RDWR | os.O_CREAT, 0o600)
        return self.fds[i]

    def _name(self, i: int) -> str:
        return os.path.join(self.dir, f"bucket{i:05d}.bin")

    def load(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Give contiguous ``tensors`` their storage back and read file ``i`` into them.

        Raises:
            OSError: the file is shorter than the tensors.
        """
        fd, offset, t0 = self._fd(i), 0, time.perf_counter()
        for t in tensors:
            _restore(t)
            read = self.staging.read if _needs_staging(t) else _preadv_host
            offset += read(fd, t, offset, self._name(i))
        self.bytes_read += offset
        self.read_s += time.perf_counter() - t0

    def store(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Write contiguous ``tensors`` back to back as file ``i``, then free their storage."""
        fd, offset, t0 = self._fd(i), 0, time.perf_counter()
        for t in tensors:
            write = self.staging.write if _needs_staging(t) else _pwrite_host
            offset += write(fd, t, offset)
        os.ftruncate(fd, offset)
        self.bytes_written += offset
        self.write_s += time.perf_counter() - t0
        for t in tensors:
            _release(t)

    def file_bytes(self) -> int:
        """Bytes in the files now (``os.fstat``)."""
        return sum(os.fstat(fd).st_size for fd in self.fds.values())

    def stats(self) -> dict[str, float]:
        """``{"bytes_read", "bytes_written", "io_seconds", "read_bandwidth", "write_bandwidth"}``: bytes, seconds and
        bytes/s since :meth:`reset_stats` (bandwidth 0.0 when no I/O)."""
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "io_seconds": self.read_s + self.write_s,
                "read_bandwidth": self.bytes_read / self.read_s if self.read_s > 0 else 0.0,
                "write_bandwidth": self.bytes_written / self.write_s if self.write_s > 0 else 0.0}

    def close(self) -> None:
        """Close the files, remove the sub-folder and free the staging buffer (idempotent)."""
        self._close()
        self.staging.release()


def _remove(fds: dict[int, int], directory: str) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)


class DelayedUpdate:
    """DPU (one-step delayed parameter update): a thread runs the host step of step t under the forward and backward of
    step t + 1 (which use parameters one update stale) and it is published at the start of step t + 1. The first step is
    synchronous, a warm-up as in arXiv 2101.06840. ``done[i]``: bucket ``i``'s update in flight is over (its host
    gradient may be overwritten); ``unpublished``: not yet in the working parameters; ``warm``: the first step ran.
    """

    def __init__(self, buckets: int):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerolearn-dpu")
        self.future: Future | None = None
        self.done = [threading.Event() for _ in range(buckets)]  # waited on only while a step is in flight
        self.unpublished = self.warm = False

    def launch(self, job) -> None:
        """Run ``job(done)`` on the thread; it sets ``done[i]`` as it finishes bucket ``i``."""
        for event in self.done:
            event.clear()

        def run():
            try:
                job(self.done)
            finally:
                for event in self.done:  # also when it failed: nobody may wait forever
                    event.set()

        self.future = self.pool.submit(run)
        self.unpublished = True

    def wait(self) -> None:
        """Wait for the step in flight, if any; re-raise its error."""
        future, self.future = self.future, None
        if future is not None:
            future.result()

    def wait_bucket(self, i: int) -> None:
        """Wait until the step in flight no longer reads bucket ``i``'s host gradient."""
        if self.future is not None:
            self.done[i].wait()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        self.pool.shutdown(wait=True)


class Offload:
    """The offloaded state of one engine, its placement (:class:`zerolearn.engines.step.OnDevice` without offload): each
    ``b.master`` (``engine.separate_master``) becomes an fp32 host copy, before the optimizer.

    Attributes:
        kind: "cpu" or "disk".
        grads: per bucket, the fp32 host gradient shard, (``b.master.numel()``,).
        swapper: the :class:`DiskSwapper` ("disk"), else None.
        delay: the :class:`DelayedUpdate` (``dpu=True``), else None.
    """

    decides_on_host = True  # the host steps: an overflow flag is read before the step's work

    def __init__(self, engine, kind: str, directory: str | None, dpu: bool):
        self.kind, self.pin = kind, engine.device.type == "cuda"
        self.index = {id(b): i for i, b in enumerate(engine.buckets)}
        with category("optimizer_states"), location("host"):
            for b in engine.buckets:  # pinned on CUDA, for async copies
                master = torch.empty(b.master.shape, dtype=torch.float32, pin_memory=self.pin)
                master.copy_(b.master.detach())
                b.master = nn.Parameter(master)
        with category("grads"), location("host"):
            self.grads = [torch.zeros(b.master.numel(), dtype=torch.float32, pin_memory=self.pin)
                          for b in engine.buckets]
        self.has = [False] * len(engine.buckets)  # grads[i] holds this step's gradient (or part of it)
        self.swapper = DiskSwapper(directory, engine.rank) if kind == "disk" else None
        self.shards = DiskSwapper(directory, engine.rank, "params") if kind == "disk" and engine.stage == 3 else None
        self.resident_depth = 0  # open resident() blocks
        self.delay = DelayedUpdate(len(engine.buckets)) if dpu else None
        if self.swapper is not None:
            for i, b in enumerate(engine.buckets):
                self.swapper.store(i, [b.master])
        if self.shards is not None:
            for i, b in enumerate(engine.buckets):
                self.shards.store(i, [b.shard])
            self.shards.reset_stats()  # the I/O of training steps is what stats() counts

    @staticmethod
    def states(opt: optim.GroupedOptimizer, i: int, b) -> list[torch.Tensor]:
        """Bucket ``i``'s host optimizer states: the master, then the per-element states in key order."""
        st = opt.optimizers[i].state.get(b.master, {})
        return [b.master, *[st[k] for k in sorted(st) if torch.is_tensor(st[k]) and st[k].dim() > 0]]

    def host_tensors(self, engine) -> dict[str, list[torch.Tensor]]:
        """What lives on the host, by category (released tensors included; they count 0 bytes)."""
        opt = engine._optimizer
        return {"params": [], "grads": list(self.grads),
                "optimizer_states": [t for i, b in enumerate(engine.buckets) for t in self.states(opt, i, b)]}

    def disk_bytes(self) -> dict[str, int]:
        """Bytes of the files by category: ``{"params", "grads", "optimizer_states"}`` (0 where none)."""
        return {"params": self.shards.file_bytes() if self.shards is not None else 0, "grads": 0,
                "optimizer_states": self.swapper.file_bytes() if self.swapper is not None else 0}

    @contextlib.contextmanager
    def resident(self, engine):
        """Every bucket's optimizer states (and stage 3's parameter shards) in host memory for the block, after any
        DPU step in flight. Blocks may nest: the outermost one reads and writes."""
        self.wait()
        outer = self.swapper is not None and not self.resident_depth
        self.resident_depth += 1
        if outer:
            opt = engine._optimizer
            for i, b in enumerate(engine.buckets):
                self.swapper.load(i, self.states(opt, i, b))
                if self.shards is not None:
                    self.shards.load(i, [b.shard])
        try:
            yield
        finally:
            self.resident_depth -= 1
            if outer:
                for i, b in enumerate(engine.buckets):  # the states after the block (a load may replace them)
                    self.swapper.store(i, self.states(opt, i, b))
                    if self.shards is not None:
                        self.shards.store(i, [b.shard])

    def take_grad(self, engine, b) -> None:
        """Bucket ``b``'s gradient shard into its host fp32 buffer: moved at stages 2-3 (a later backward adds to
        it), copied over it at stage 1 (the stage accumulates in its full gradient)."""
        grad = engine._grad_for_step(b)
        if grad is None:
            return
        i = self.index[id(b)]
        if self.delay is not None:
            self.delay.wait_bucket(i)  # the update in flight has read grads[i]
        moved = grad is b.grad_shard
        if moved and self.has[i]:
            self.grads[i].add_(grad.to("cpu", torch.float32))
        else:
            self.grads[i].copy_(grad, non_blocking=self.pin)
        if moved:
            b.grad_shard = None
        self.has[i] = True

    def zero_grad(self) -> None:
        self.has = [False] * len(self.has)
        if self.shards is not None:
            self.shards.reset_stats()  # the parameter shards' I/O is counted per iteration

    def loaded(self, engine) -> None:
        """A checkpoint was loaded (and published) inside :meth:`resident`: the state tensors become copies of their
        own (torch may keep the caller's, which a disk swap releases)."""
        if self.delay is not None:
            self.delay.unpublished = False
        if self.swapper is not None:
            for o in engine._optimizer.optimizers:
                for st in o.state.values():
                    st.update({k: v.clone() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})

    def shard_in(self, b) -> None:
        """Before an all_gather reads ``b.shard``: read it from its file if it is on disk and released."""
        if self.shards is not None and b.shard.untyped_storage().nbytes() == 0:
            self.shards.load(self.index[id(b)], [b.shard])

    def shard_out(self, b) -> None:
        """The all_gather that read ``b.shard`` finished: release its memory (its file holds it)."""
        if self.shards is not None and not self.resident_depth:  # inside resident(): kept until its end
            _release(b.shard)

    @contextlib.contextmanager
    def publishing(self, b):
        """Around ``_publish(b)`` at stage 3 on disk: the shard's memory back (unread), then stored and released."""
        if self.shards is None or self.resident_depth:  # inside resident(): written at its end
            yield
            return
        _restore(b.shard)
        yield
        self.shards.store(self.index[id(b)], [b.shard])

    def land(self, engine, starts_step: bool = True) -> None:
        """Finish and publish the DPU update in flight (a collective at stages 1-2); ``starts_step``: reset I/O."""
        if self.swapper is not None and starts_step:
            self.swapper.reset_stats()
        if self.delay is None:
            return
        self.delay.wait()
        if self.delay.unpublished:
            for b in engine.buckets:
                if self.swapper is not None:  # the master alone, read to be published
                    self.swapper.load(self.index[id(b)], [b.master])
                with comm.unit(b.layout.label, "step: publish"), self.publishing(b):
                    engine._publish(b)
                if self.swapper is not None:
                    _release(b.master)
            engine._finish_publish()
            self.delay.unpublished = False

    def grads_for_step(self, engine) -> list[torch.Tensor]:
        """The host fp32 gradient of every bucket for this step (synchronised on CUDA)."""
        for i, b in enumerate(engine.buckets):
            if not self.has[i]:  # no reducing backward since zero_grad: what the stage holds, or 0
                grad = engine._grad_for_step(b)
                self.grads[i].copy_(grad) if grad is not None else self.grads[i].zero_()
                self.has[i] = True
        if self.pin:
            torch.cuda.current_stream(engine.device).synchronize()
        return self.grads

    def _update(self, opt: optim.GroupedOptimizer, i: int, b, coef: float, parts) -> None:
        """torch's optimizer on the host: bucket ``i``'s master from its host gradient."""
        if self.swapper is not None:
            self.swapper.load(i, self.states(opt, i, b))
        b.master.grad = self.grads[i]
        if coef != 1.0:
            b.master.grad.mul_(coef)
        with location("host"):  # the moments torch creates, and the step's temporaries
            opt.step_bucket(i, parts)
        b.master.grad = None

    def step(self, engine, grads: list[torch.Tensor], used: list[list[bool]], coef: float, found_inf=None) -> None:
        """The host step of every bucket from ``grads``, then publish (under DPU after the first step: on the thread,
        published by the next :meth:`land`). ``found_inf`` is None (:attr:`decides_on_host`)."""
        opt = engine._optimizer
        parts = [optim.parts_to_step(opt, i, b, used[i]) for i, b in enumerate(engine.buckets)]
        if self.delay is not None and self.delay.warm:
            for b in engine.buckets:  # the thread sets .grad from here on: nothing held is left to clear
                b.master.grad = None

            def job(done) -> None:  # on the DPU thread: no collective, no working parameter; host tensors only
                for i, b in enumerate(engine.buckets):
                    self._update(opt, i, b, coef, parts[i])
                    if self.swapper is not None:
                        self.swapper.store(i, self.states(opt, i, b))
                    done[i].set()

            self.delay.launch(job)
            return
        for i, b in enumerate(engine.buckets):
            self._update(opt, i, b, coef, parts[i])
            retag(optim.optimizer_state(opt, b.master), "optimizer_states")
            with comm.unit(b.layout.label, "step: publish"), self.publishing(b):
                engine._publish(b)
            if self.swapper is not None:
                self.swapper.store(i, self.states(opt, i, b))
        engine._finish_publish()
        if self.delay is not None:
            self.delay.warm = True

    def wait(self) -> None:
        """Wait for the DPU step in flight (no-op without DPU or from its own thread)."""
        if self.delay is not None and not threading.current_thread().name.startswith("zerolearn-dpu"):
            self.delay.wait()

    def stats(self) -> dict[str, float]:
        """:meth:`DiskSwapper.stats` of the states since the step began (zeros without disk), and under ``param_`` keys
        of the stage-3 parameter shards since ``zero_grad``."""
        self.wait()
        zero = {"bytes_read": 0, "bytes_written": 0, "io_seconds": 0.0, "read_bandwidth": 0.0,
                "write_bandwidth": 0.0}
        out = zero if self.swapper is None else self.swapper.stats()
        params = zero if self.shards is None else self.shards.stats()
        return {**out, **{f"param_{k}": v for k, v in params.items()}}

    def close(self) -> None:
        """Wait for a DPU step in flight, stop its thread, remove the files (idempotent)."""
        for part in (self.delay, self.swapper, self.shards):
            if part is not None:
                part.close()
