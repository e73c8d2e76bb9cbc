"""Offload: the optimizer's step on the host (ZeRO-Offload) and its states on disk (ZeRO-Infinity).

ZeRO-Offload (Ren et al., USENIX ATC 2021, arXiv 2101.06840) runs on top of ZeRO-2:
the 2-byte working parameters stay on the device, where forward and backward run; the
fp32 optimizer states (master and moments) and the fp32 gradients live in host memory,
and the optimizer's step runs on the CPU. Its one-step delayed parameter update (DPU)
overlaps the CPU step of step t with the forward and backward of step t + 1, which then
use parameters one update stale. ZeRO-Infinity (Rajbhandari et al., SC'21, arXiv
2104.07857) puts ZeRO-3's optimizer states (and parameters) on CPU memory and NVMe.

An engine built with ``offload="cpu"`` (stages 1-3) keeps, on each rank:

* on the device: the working parameters (full at stages 1-2, the shard at stage 3), the
  gradient buckets while they are reduced, and at stage 1 the full gradient (P_os does
  not partition gradients);
* in host memory (pinned on CUDA): the fp32 master shard, the optimizer's moments, and
  an fp32 buffer of the gradient shard the step uses. At stages 2-3 each reduced
  gradient shard moves there as soon as its reduction finishes and the device copy is
  dropped. The device-to-host gradient copies are ``non_blocking`` and synchronised
  (the device's stream) before the host reads them; the host-to-device copy of the
  updated master in ``_publish`` is synchronous, so the host may change or release the
  master right after.

torch's own optimizer steps the host master (:meth:`GroupedOptimizer.step_bucket`), and
the stage's ``_publish`` copies the updated master back to the device's working
parameters (the all_gather of stages 1-2, the shard's copy at stage 3). On a CPU-only
run device and host are the same memory: the engine still keeps the offloaded tensors
as host tensors of their own, apart from the working ones, and counts them as "host"
(:meth:`zerolearn.engines.state.EngineStateMixin.model_state_bytes_by_location`).

``offload="disk"`` does the same, and keeps each bucket's optimizer states (master and
moments) in a file of its own (:class:`DiskSwapper`): read into host memory just before
that bucket's step, written back right after and released, so at most one bucket's
optimizer states are in host memory at once. At stage 3 the working parameter shards go
to disk too (ZeRO-Infinity's parameter offload, Sec 5): a shard is read from its file
just before its unit's all_gather (forward, backward, each prefetch), released once the
gather has finished, and written back after the step updates it, so between uses a rank
holds no parameter memory at all. File I/O only ever touches host memory: on CUDA a
shard crosses between the device and its file through one reused, pinned host buffer
(:class:`HostStaging`). The reads are synchronous, on the calling thread;
ZeRO-Infinity prefetches parameters layer by layer under compute (its overlap-centric
design), which this teaching engine does not.

Where this differs from DeepSpeed's NVMe path: DeepSpeed also swaps the fp32 gradients
to NVMe, and pipelines the optimizer states' swaps with the CPU's step; here, under
``offload="disk"``, the fp32 gradient shard stays in host memory (4 Psi / Nd bytes
per rank) and a bucket's states are read, stepped and written in turn,
so that the bytes on disk are exactly the optimizer states (and the stage-3 shards).

``dpu=True`` (with either offload) runs the host step of step t on a background thread
(:class:`DelayedUpdate`) and publishes it at the start of step t + 1; the first step
is synchronous: a warm-up, as in the paper (ZeRO-Offload turns DPU on only after the
first steps, whose gradients change the parameters the most).
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
    """Refuse bad offload options before any work or collective.

    A given ``offload_dir`` is created if missing and probed with a real temporary file
    (permission bits alone do not say whether the process may write there).

    Raises:
        ConfigError: ``offload`` not None, "cpu" or "disk"; offload at a stage other than
            1-3 (stage 0 partitions nothing to offload); ``dpu`` not a bool, or True
            without offload; ``offload_dir`` without ``offload="disk"``, or a folder
            that cannot be created or written.
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
    """Create folder ``path`` if missing and write a temporary file in it.

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


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An fp32 host tensor with ``t``'s values (pinned when ``pin``, for async copies)."""
    out = torch.empty(t.shape, dtype=torch.float32, pin_memory=pin)
    out.copy_(t)
    return out


def _release(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _restore(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of host tensor ``t`` (contiguous) as a writable buffer for ``os.preadv``
    and ``os.pwrite``. Through ctypes, not ``numpy()``: sharing a tensor with numpy
    makes its storage non-resizable for good, and the swapper resizes it.

    Raises:
        ValueError: ``t`` is not in host memory (a CUDA tensor's address means nothing to
            the operating system's file calls: ``OSError: Bad address`` at best), or not
            contiguous.
    """
    if t.device.type != "cpu":
        raise ValueError(f"file I/O needs host memory; got a tensor on {t.device} (stage it through a host "
                         "buffer: DiskSwapper does)")
    if not t.is_contiguous():
        raise ValueError(f"file I/O needs a contiguous tensor; got strides {t.stride()} for shape {tuple(t.shape)}")
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _pwrite_host(fd: int, t: torch.Tensor, offset: int) -> int:
    """Write all the bytes of host tensor ``t`` to file ``fd`` at byte ``offset``; the bytes written.
    With :func:`_preadv_host`, the only place file I/O meets tensor memory."""
    view, done = _bytes_view(t), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _preadv_host(fd: int, t: torch.Tensor, offset: int, name: str) -> int:
    """Fill host tensor ``t`` from file ``fd`` (called ``name``) at byte ``offset``; the bytes read.

    Raises:
        OSError: the file ends before ``t`` is full.
    """
    view, done = _bytes_view(t), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"offload file {name} ends at byte {offset + done}; expected {offset + len(view)}")
        done += got
    return done


STAGING_MB = 32.0
"""Size cap of the host buffer through which device tensors cross to and from files (MiB):
a larger tensor crosses in pieces of this size."""


def _needs_staging(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is not the host's (a CUDA tensor), so file I/O must go through a host buffer."""
    return t.device.type != "cpu"


class HostStaging:
    """One host buffer, reused, through which device tensors cross to and from files.

    Pinned when CUDA is present, so the device's copies into and out of it run at full
    speed; at most ``cap_bytes`` (a larger tensor crosses in pieces), allocated on first
    use and grown up to the cap as larger tensors come. Every copy through it is
    synchronous (``copy_`` without ``non_blocking``), so the buffer may be reused as soon
    as a copy returns.

    Args:
        cap_bytes: the buffer's largest size in bytes, >= 1.

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
        """Write device tensor ``t`` (contiguous) to file ``fd`` at ``offset``, piece by piece
        through the buffer; the bytes written."""
        flat, done = t.reshape(-1).view(torch.uint8), 0
        while done < flat.numel():
            piece = self.take(flat.numel() - done)
            piece.copy_(flat[done:done + piece.numel()])  # device -> host, synchronous
            done += _pwrite_host(fd, piece, offset + done)
        return done

    def read(self, fd: int, t: torch.Tensor, offset: int, name: str) -> int:
        """Fill device tensor ``t`` (contiguous) from file ``fd`` at ``offset``, piece by piece
        through the buffer; the bytes read.

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
    """Each bucket's optimizer states in a file of their own, read and written for real.

    File ``i`` holds bucket ``i``'s tensors back to back (the fp32 master, then the
    optimizer's per-element states in key order; only the master before the first step,
    whose moments torch creates; at stage 3 also the working parameter shards, in a
    swapper of their own), written with ``os.pwrite`` and read with ``os.preadv``. Host
    tensors are read and written in place; device tensors (CUDA) cross through one
    reused, pinned host buffer (:class:`HostStaging`), so file I/O only ever sees host
    memory. Between reads a tensor's storage is resized to 0 bytes (as ZeRO-3 frees a
    gathered unit): the tensor object, which the optimizer holds, stays. Bytes and
    seconds are counted; the files go through the operating system's page cache, so the
    bandwidth measured is that of the file path, not necessarily the device's.

    Args:
        directory: where the files go (a private sub-folder is made in it); None: a new
            temporary folder. Either way the sub-folder is removed by :meth:`close` or
            when the swapper is garbage-collected.
        rank: the rank, for the sub-folder's name.
        what: what the files hold, for the sub-folder's name ("states", "params").
    """

    def __init__(self, directory: str | None, rank: int, what: str = "states"):
        self.dir = tempfile.mkdtemp(prefix=f"zerolearn-offload-{what}-rank{rank}-", dir=directory)
        self.fds: dict[int, int] = {}
        self.staging = HostStaging()
        self.reset_stats()
        self._close = weakref.finalize(self, _remove, self.fds, self.dir)

    def reset_stats(self) -> None:
        """Start counting bytes and seconds afresh (the engine does so at every step)."""
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = 0.0

    def _fd(self, i: int) -> int:
        if i not in self.fds:
            self.fds[i] = os.open(self._name(i), os.O_RDWR | os.O_CREAT, 0o600)
        return self.fds[i]

    def _name(self, i: int) -> str:
        return os.path.join(self.dir, f"bucket{i:05d}.bin")

    def load(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Give ``tensors`` (contiguous; host, or a device's through the staging buffer) their
        storage back and read file ``i`` into them.

        Raises:
            OSError: the file is shorter than the tensors (it was truncated behind our back).
        """
        fd, offset, t0 = self._fd(i), 0, time.perf_counter()
        for t in tensors:
            _restore(t)
            if _needs_staging(t):
                offset += self.staging.read(fd, t, offset, self._name(i))
            else:
                offset += _preadv_host(fd, t, offset, self._name(i))
        self.bytes_read += offset
        self.read_s += time.perf_counter() - t0

    def store(self, i: int, tensors: list[torch.Tensor], release: bool = True) -> None:
        """Write ``tensors`` (contiguous; host, or a device's through the staging buffer) back
        to back into file ``i`` (its length: their bytes), then release their storage
        (``release``)."""
        fd, offset, t0 = self._fd(i), 0, time.perf_counter()
        for t in tensors:
            if _needs_staging(t):
                offset += self.staging.write(fd, t, offset)
            else:
                offset += _pwrite_host(fd, t, offset)
        os.ftruncate(fd, offset)
        self.bytes_written += offset
        self.write_s += time.perf_counter() - t0
        if release:
            for t in tensors:
                _release(t)

    def file_bytes(self) -> int:
        """Bytes in the files now (their sizes on disk, as ``os.fstat`` says)."""
        return sum(os.fstat(fd).st_size for fd in self.fds.values())

    def stats(self) -> dict[str, float]:
        """``{"bytes_read", "bytes_written", "io_seconds", "read_bandwidth", "write_bandwidth"}``:
        bytes, seconds and bytes/s since :meth:`reset_stats` (bandwidth 0.0 when no I/O)."""
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
    """DPU: one background thread that runs the host step of one engine step at a time.

    ``done[i]`` is set once bucket ``i``'s update of the step in flight is over: the next
    backward may then write bucket ``i``'s new gradient into the host buffer the update
    read. ``unpublished``: an update finished (or in flight) that the working parameters
    do not show yet. ``warm``: a synchronous step has run (the first one always is).
    """

    def __init__(self, buckets: int):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerolearn-dpu")
        self.future: Future | None = None
        self.done = [threading.Event() for _ in range(buckets)]
        for event in self.done:
            event.set()
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
    """The offloaded state of one engine: host masters and gradients, disk files, DPU.

    Built by :class:`zerolearn.engines.base.Engine` after the stage's ``_init_bucket``
    and before the optimizer: each ``b.master`` (the stage made it a tensor of its own,
    ``engine.separate_master``) is replaced by an fp32 host copy.

    Attributes:
        kind: "cpu" or "disk".
        grads: per bucket, the fp32 host gradient shard, (``b.master.numel()``,).
        swapper: the :class:`DiskSwapper` ("disk"), else None.
        delay: the :class:`DelayedUpdate` (``dpu=True``), else None.

    The engine calls it as its placement, as it calls :class:`zerolearn.engines.step.OnDevice`
    without offload: ``land``, ``grads_for_step``, ``step``, ``take_grad``, ``shard_in``,
    ``shard_out``, ``publishing``, ``zero_grad``, ``wait``, ``stats``, ``close``.
    """

    decides_on_host = True  # the host steps: an overflow flag is read before the step's work

    def __init__(self, engine, kind: str, directory: str | None, dpu: bool):
        self.kind, self.pin = kind, engine.device.type == "cuda"
        self.index = {id(b): i for i, b in enumerate(engine.buckets)}
        with category("optimizer_states"), location("host"):
            for b in engine.buckets:
                b.master = nn.Parameter(_host_copy(b.master.detach(), self.pin))
        with category("grads"), location("host"):
            self.grads = [torch.zeros(b.master.numel(), dtype=torch.float32, pin_memory=self.pin)
                          for b in engine.buckets]
        self.has = [False] * len(engine.buckets)  # grads[i] holds this step's gradient (or part of it)
        self.swapper = DiskSwapper(directory, engine.rank) if kind == "disk" else None
        # Stage 3 on disk: the working parameter shards in files of their own (ZeRO-Infinity).
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

    # ----- the states of a bucket ---------------------------------------------------------
    @staticmethod
    def states(opt: optim.GroupedOptimizer, i: int, b) -> list[torch.Tensor]:
        """Bucket ``i``'s optimizer states on the host: the master, then the per-element
        state tensors in key order (Adam: ``exp_avg``, ``exp_avg_sq``)."""
        st = opt.optimizers[i].state.get(b.master, {})
        return [b.master, *[st[k] for k in sorted(st) if torch.is_tensor(st[k]) and st[k].dim() > 0]]

    def host_tensors(self, engine) -> dict[str, list[torch.Tensor]]:
        """What lives on the host, by category (released tensors included; they count 0 bytes)."""
        opt = engine._optimizer
        return {"params": [], "grads": list(self.grads),
                "optimizer_states": [t for i, b in enumerate(engine.buckets) for t in self.states(opt, i, b)]}

    def disk_bytes(self) -> dict[str, int]:
        """Bytes of the files by category: ``{"params", "grads", "optimizer_states"}`` (0
        without disk offload; parameters only at stage 3)."""
        return {"params": self.shards.file_bytes() if self.shards is not None else 0, "grads": 0,
                "optimizer_states": self.swapper.file_bytes() if self.swapper is not None else 0}

    @contextlib.contextmanager
    def resident(self, engine):
        """Every bucket's optimizer states in host memory for the block (disk: read all,
        then written back and released), and at stage 3 on disk the working parameter
        shards too; waits for a DPU step in flight first. Blocks
        may nest (a checkpoint's save inside the training loop's): the outermost one
        reads and writes."""
        self.wait()
        if self.swapper is None or self.resident_depth:
            self.resident_depth += 1
            try:
                yield
            finally:
                self.resident_depth -= 1
            return
        self.resident_depth = 1
        opt = engine._optimizer
        for i, b in enumerate(engine.buckets):
            self.swapper.load(i, self.states(opt, i, b))
            if self.shards is not None:
                self.shards.load(i, [b.shard])
        try:
            yield
        finally:
            self.resident_depth = 0
            for i, b in enumerate(engine.buckets):  # the states after the block (a load may replace them)
                self.swapper.store(i, self.states(opt, i, b))
                if self.shards is not None:
                    self.shards.store(i, [b.shard])

    # ----- backward: each reduced shard to the host -----------------------------------------
    def take_grad(self, engine, b) -> None:
        """Bucket ``b``'s reduction finished: its gradient shard into the host's fp32 buffer.

        At stages 2-3 the stage keeps the shard only for the step (``b.grad_shard``): it
        is moved, the device copy dropped, and a later reducing backward before the step
        (accumulation) adds to the host buffer in fp32. At stage 1 the stage keeps the
        full gradient and accumulates in it: the shard is copied, replacing the buffer.
        """
        grad = engine._grad_for_step(b)
        if grad is None:
            return
        i = self.index[id(b)]
        if self.delay is not None:
            self.delay.wait_bucket(i)  # the update in flight has read grads[i]
        host = self.grads[i]
        moved = grad is b.grad_shard
        if moved and self.has[i]:
            host.add_(grad.to("cpu", torch.float32))
        else:
            host.copy_(grad, non_blocking=self.pin)
        if moved:
            b.grad_shard = None
        self.has[i] = True

    def zero_grad(self) -> None:
        self.has = [False] * len(self.has)
        if self.shards is not None:
            self.shards.reset_stats()  # the parameter shards' I/O is counted per iteration

    def loaded(self, engine) -> None:
        """A checkpoint was loaded (inside :meth:`resident`): the loaded state is published
        already, and the optimizer's state tensors become the swapper's own (torch's
        ``load_state_dict`` may keep the caller's tensors, whose storage a disk swap
        releases)."""
        if self.delay is not None:
            self.delay.unpublished = False
        if self.swapper is not None:
            for o in engine._optimizer.optimizers:
                for st in o.state.values():
                    for k, v in st.items():
                        if torch.is_tensor(v) and v.dim() > 0:
                            st[k] = v.clone()

    # ----- stage 3 on disk: the working parameter shards ------------------------------------
    def shard_in(self, b) -> None:
        """Before an all_gather reads ``b.shard``: read it from its file (stage 3 on disk;
        nothing when it is in memory already or parameters are not on disk)."""
        if self.shards is not None and b.shard.untyped_storage().nbytes() == 0:
            self.shards.load(self.index[id(b)], [b.shard])

    def shard_out(self, b) -> None:
        """The all_gather that read ``b.shard`` finished: release its memory (its file holds it)."""
        if self.shards is not None and not self.resident_depth:  # inside resident(): kept until its end
            _release(b.shard)

    @contextlib.contextmanager
    def publishing(self, b):
        """Around the stage's ``_publish(b)``: at stage 3 on disk the shard gets its memory
        back (not read: the publish overwrites all of it), then is written to its file and
        released."""
        if self.shards is None or self.resident_depth:  # inside resident(): written at its end
            yield
            return
        _restore(b.shard)
        yield
        self.shards.store(self.index[id(b)], [b.shard])

    # ----- step ---------------------------------------------------------------------------
    def land(self, engine, starts_step: bool = True) -> None:
        """Before a step (``starts_step``: the I/O counts start afresh) or on demand: the
        DPU update in flight finishes and is published (a collective at stages 1-2)."""
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
        """The host step of every bucket from ``grads`` (:meth:`grads_for_step`), then
        publish; under DPU (after the first step) launched on the background thread and
        published by the next :meth:`land`. ``found_inf`` is None: the host decided the
        step already (:attr:`decides_on_host`)."""
        opt = engine._optimizer
        parts = [optim.parts_to_step(opt, i, b, used[i]) for i, b in enumerate(engine.buckets)]
        if self.delay is not None and self.delay.warm:
            for b in engine.buckets:  # the thread sets .grad from here on: nothing held is left to clear
                b.master.grad = None
            self.delay.launch(lambda done: self._delayed(opt, engine.buckets, coef, parts, done))
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

    def _delayed(self, opt, buckets, coef: float, parts, done) -> None:
        # On the DPU thread: no collective, no working parameter; host tensors only.
        for i, b in enumerate(buckets):
            self._update(opt, i, b, coef, parts[i])
            if self.swapper is not None:
                self.swapper.store(i, self.states(opt, i, b))
            done[i].set()

    def wait(self) -> None:
        """Wait for the DPU step in flight (no-op without DPU or from its own thread)."""
        if self.delay is not None and not threading.current_thread().name.startswith("zerolearn-dpu"):
            self.delay.wait()

    def stats(self) -> dict[str, float]:
        """:meth:`DiskSwapper.stats` of the optimizer states since the last step began
        (zeros without disk), and at stage 3 on disk the parameter shards' I/O since the
        last ``zero_grad``, under ``param_`` keys: one iteration's forward and backward
        reads and the step's writes, when read right after the step."""
        self.wait()
        zero = {"bytes_read": 0, "bytes_written": 0, "io_seconds": 0.0, "read_bandwidth": 0.0,
                "write_bandwidth": 0.0}
        out = dict(zero) if self.swapper is None else self.swapper.stats()
        params = zero if self.shards is None else self.shards.stats()
        return {**out, **{f"param_{k}": v for k, v in params.items()}}

    def close(self) -> None:
        """Wait for a DPU step in flight, stop its thread, remove the files (idempotent)."""
        if self.delay is not None:
            self.delay.close()
        if self.swapper is not None:
            self.swapper.close()
        if self.shards is not None:
            self.shards.close()
