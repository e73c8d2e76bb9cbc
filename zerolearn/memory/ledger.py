"""Measured memory: bytes per category, the peak, and a timeline over a training step.

The analytic model (``memory/model.py``) says what a rank *should* hold; the ledger
watches what it *does* hold, on any device. While active it sees every tensor an
operator creates (a ``TorchDispatchMode``), follows each storage until it is freed
(a weak reference on the storage) or resized (ZeRO-3 frees a gathered unit by
resizing its storage to 0 bytes and gathers it back into the same storage), and keeps
a running total, its peak and a timeline.

Each storage gets one category when it appears (Sec 3 of the paper splits memory
into model states and residual states):

* ``params``, ``grads``, ``optimizer_states``: the engine's tensors, registered by
  :meth:`MemoryLedger.track` or created inside ``with category(...)`` blocks;
* ``activations``: anything else created during forward (what autograd saves, and
  the forward's own temporaries);
* ``temporary``: anything else created during backward or the step (activation
  gradients, communication and casting buffers).

On CUDA, ``torch.cuda.max_memory_allocated`` gives the allocator's own peak; the
ledger adds the categories and the timeline there too. Tensors that existed before
the ledger started are invisible to it unless registered with :meth:`track`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("params", "grads", "optimizer_states", "activations", "temporary")
LOCATIONS = ("device", "host")
_PHASE_DEFAULT = {"forward": "activations", "backward": "temporary", "step": "temporary"}

_state = threading.local()


@contextlib.contextmanager
def _tagged(key: str, value: str):
    """Set this thread's ``key`` tag for storages created inside the block."""
    previous = getattr(_state, key, None)
    setattr(_state, key, value)
    try:
        yield
    finally:
        setattr(_state, key, previous)


def category(name: str):
    """Storages created inside this block belong to ``name`` (one of CATEGORIES).

    Costs nothing when no ledger is active, so engines can mark their allocations.
    """
    return _tagged("category", name)


def location(name: str):
    """Storages created inside this block live in ``name``'s memory: ``"device"`` (the
    default) or ``"host"`` (offload: :mod:`zerolearn.engines.offload` creates its host
    copies, and torch's optimizer steps, inside ``location("host")``). On a CPU-only run
    both are the same memory; the ledger keeps them apart by this tag, as on a GPU.

    Costs nothing when no ledger is active.
    """
    return _tagged("location", name)


def retag(tensors, name: str) -> None:
    """Move already-tracked storages to category ``name`` in the active ledger, if any.

    For tensors whose role is known only after they exist, e.g. the optimizer's
    moments, created inside ``optimizer.step()`` among its temporaries.
    """
    ledger = getattr(_state, "ledger", None)
    if ledger is not None:
        for t in tensors:
            ledger._retag(t.untyped_storage(), name)


def storage_bytes(tensors, seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and empty storages skipped).

    Args:
        tensors: an iterable of tensors or None; views of one storage count it once.
        seen: storage addresses already counted, shared across calls so that a storage
            is counted once over several calls (updated in place); None: a fresh set.

    Returns:
        bytes, the sum of ``untyped_storage().nbytes()`` over storages not yet seen.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


@dataclass
class Event:
    """One point of the timeline: after an allocation, free or resize."""

    index: int
    phase: str
    total: int  # bytes live in tracked storages
    by_category: dict[str, int]
    label: str = ""


@dataclass
class _Storage:
    nbytes: int
    category: str
    ref: weakref.ref = field(repr=False)
    location: str = "device"


class MemoryLedger(TorchDispatchMode):
    """Track live tensor storages by category; peak and timeline in bytes.

    Use as a context manager around the code to measure, with :meth:`phase` blocks
    for ``"forward"``, ``"backward"`` and ``"step"``::

        with MemoryLedger() as ledger:
            ledger.track_engine(engine)
            with ledger.phase("forward"):
                loss = ...
            ...
        ledger.peak, ledger.peak_by_category, ledger.timeline

    Attributes: ``live`` (bytes per category now), ``peak`` (bytes), ``peak_by_category``
    (the categories at the moment of the peak), ``timeline`` (list of :class:`Event`),
    and per location (``"device"``, ``"host"``: see :func:`location`) ``live_by_location``
    and ``peak_by_location`` ({location: {category: bytes}}, now and at the peak).
    """

    def __init__(self, record_timeline: bool = True, record_trace: bool = False):
        super().__init__()
        # trace: ("alloc" | "free", storage uid, bytes, phase) in order, for replaying
        # tensor lifetimes through an allocator (residual/defrag.py).
        self.record_trace, self.trace = record_trace, []
        self._uids: dict[int, int] = {}  # storage key -> a uid never reused
        self._next_uid = 0
        self.live: dict[str, int] = defaultdict(int)
        self.live_by_location = {loc: defaultdict(int) for loc in LOCATIONS}
        self.peak_by_location = {loc: {c: 0 for c in CATEGORIES} for loc in LOCATIONS}
        self.peak, self.peak_by_category = 0, {c: 0 for c in CATEGORIES}
        self.timeline: list[Event] = []
        self.record_timeline = record_timeline
        self._storages: dict[int, _Storage] = {}
        self._phase = "setup"
        self._original_resize = None

    # ----- registration -------------------------------------------------------------
    def track(self, tensors, name: str, where: str = "device") -> None:
        """Register existing tensors (None entries are skipped) under category ``name``,
        in ``where``'s memory (``"device"`` or ``"host"``)."""
        for t in tensors:
            if t is not None:
                self._add(t.untyped_storage(), name, where)

    def track_engine(self, engine) -> None:
        """Register an engine's current model states, by location when it offloads
        (``Engine.state_tensors_by_location``), else all on the device (``state_tensors``)."""
        by_location = getattr(engine, "state_tensors_by_location", None)
        placed = by_location() if by_location is not None else {"device": engine.state_tensors()}
        for where, by_category in placed.items():
            for name, tensors in by_category.items():
                self.track(tensors, name, where)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Mark a phase (``forward``, ``backward``, ``step``) for defaults and the timeline."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def mark(self, label: str) -> None:
        """Add a labelled point to the timeline (e.g. "step 3 starts")."""
        self._record(label)

    # ----- bookkeeping ----------------------------------------------------------------
    def _add(self, storage: torch.UntypedStorage, name: str | None = None, where: str | None = None) -> None:
        key = id(storage)
        if key in self._storages:
            return
        name = name or getattr(_state, "category", None) or _PHASE_DEFAULT.get(self._phase, "temporary")
        where = where or getattr(_state, "location", None) or "device"
        ref = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._storages[key] = _Storage(storage.nbytes(), name, ref, where)
        self._new_uid(key)
        self._trace("alloc", key, storage.nbytes())
        self._change(name, storage.nbytes(), where)

    def _free(self, key: int) -> None:
        info = self._storages.pop(key, None)
        if info is not None:
            self._trace("free", key, info.nbytes)
            self._uids.pop(key, None)
            self._change(info.category, -info.nbytes, info.location)

    def _new_uid(self, key: int) -> None:
        self._uids[key], self._next_uid = self._next_uid, self._next_uid + 1

    def _trace(self, event: str, key: int, nbytes: int) -> None:
        if self.record_trace and nbytes > 0:
            self.trace.append((event, self._uids[key], nbytes, self._phase))

    def _retag(self, storage: torch.UntypedStorage, name: str) -> None:
        info = self._storages.get(id(storage))
        if info is None or info.category == name:
            return
        self.live[info.category] -= info.nbytes
        self.live_by_location[info.location][info.category] -= info.nbytes
        info.category = name
        self.live[name] += info.nbytes
        self.live_by_location[info.location][name] += info.nbytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        info = self._storages.get(id(storage))
        if info is None:
            self._add(storage)
            return
        old, info.nbytes = info.nbytes, storage.nbytes()
        # A resize is a free of the old block and an allocation of the new one.
        self._trace("free", id(storage), old)
        self._new_uid(id(storage))
        self._trace("alloc", id(storage), info.nbytes)
        self._change(info.category, info.nbytes - old, info.location)

    def _change(self, name: str, delta: int, where: str = "device") -> None:
        if delta == 0:
            return
        self.live[name] += delta
        self.live_by_location[where][name] += delta
        total = sum(self.live.values())
        if total > self.peak:
            self.peak = total
            self.peak_by_category = {c: self.live.get(c, 0) for c in CATEGORIES}
            self.peak_by_location = {loc: {c: live.get(c, 0) for c in CATEGORIES}
                                     for loc, live in self.live_by_location.items()}
        self._record()

    def by_location(self) -> dict:
        """``{"live": {location: {category: bytes}}, "peak": {...}}``: the categories split
        into device and host memory, now and at the peak (:func:`location`)."""
        return {"live": {loc: {c: live.get(c, 0) for c in CATEGORIES} for loc, live in self.live_by_location.items()},
                "peak": {loc: dict(by_cat) for loc, by_cat in self.peak_by_location.items()}}

    def _record(self, label: str = "") -> None:
        if self.record_timeline:
            self.timeline.append(Event(len(self.timeline), self._phase, sum(self.live.values()),
                                       {c: self.live.get(c, 0) for c in CATEGORIES}, label))

    # ----- the dispatch mode ---------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place op) is no new
        # memory, even when that input was allocated before the ledger started.
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._add(storage)
        return out

    def __enter__(self):
        # Storage resizes bypass the dispatcher: watch them directly while active.
        self._original_resize = original = torch.UntypedStorage.resize_
        ledger = self

        def resize_(storage, size):
            result = original(storage, size)
            ledger._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._outer, _state.ledger = getattr(_state, "ledger", None), self
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        _state.ledger = self._outer
        return super().__exit__(*exc)

    def summary(self) -> dict:
        """``{"peak_bytes", "peak_by_category", "live_by_category"}`` as plain ints."""
        return {"peak_bytes": self.peak, "peak_by_category": dict(self.peak_by_category),
                "live_by_category": {c: self.live.get(c, 0) for c in CATEGORIES}}
