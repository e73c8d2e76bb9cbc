"""No host read of a tensor's value inside a step: forward, backward and ``engine.step``.

On an accelerator a read of a device value (``.item()``, ``bool(t)``, ``.tolist()``,
``.cpu()``) makes the host wait until the device has caught up: the step's kernels
can no longer be queued ahead. On the CPU such a read costs nothing, so the test
counts every one of them there: whatever the CPU reads, a GPU would wait for.

The reads are counted by wrapping the methods and functions that hand a tensor's value
to Python (:data:`READS`) for the duration of each call, on every thread. Waiting for a
collective (``Work.wait``) is not a read of a value and is not counted. Two kinds of
read are left out, each named in :func:`_excused`: torch.optim's own read of its step
counter, a 0-dim tensor torch keeps on the host on every device; and, where the host
holds the gradient (the CPU, :attr:`Engine.flags_from_grads`), stage 0's look at its
reduced gradient to learn which parameters were used (on an accelerator the flags are
exchanged instead; the test runs that choice too). ZeRO-3's agreement checks (which units
every rank runs and computes gradients for, through :func:`zerolearn.guard.propose`) run
only in debug mode: by default there are none; with debug mode on they are counted apart.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import pytest
import torch

from jobs import global_batch, gpt_loss, on_ranks, small_gpt

pytestmark = pytest.mark.quick

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero", "cpu", "to")
FUNCTIONS = ("equal", "allclose", "is_nonzero", "nonzero")
CONFIGS = [  # (name, engine options, micro-batches, micro-batches inside no_sync)
    ("fp32", {}, 1, 0),
    ("bf16", {"dtype": "bf16"}, 1, 0),
    ("fp16", {"dtype": "fp16"}, 1, 0),
    ("clip", {"max_grad_norm": 0.5}, 1, 0),
    ("fp16+clip", {"dtype": "fp16", "max_grad_norm": 0.5}, 1, 0),
    ("accumulate", {}, 2, 0),
    ("no_sync", {"dtype": "bf16"}, 2, 1),
]
STAGES = (0, 1, 2, 3)
_HERE = os.path.abspath(__file__)
_OPTIM = os.sep + os.path.join("torch", "optim") + os.sep


def _reads_value(name: str, args: tuple, kwargs: dict) -> bool:
    """``t.to(...)`` and ``t.cpu()`` read a value only when they bring it to the host from
    another device; on the CPU they are copies. Every other name in READS hands the value
    to Python."""
    if name not in ("to", "cpu"):
        return True
    t = args[0]
    if t.device.type == "cpu":
        return False
    if name == "cpu":
        return True
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return target is not None and torch.device(target).type == "cpu"


def _caller() -> tuple[str, int, str]:
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == _HERE:
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name) if frame else ("?", 0, "?")


def _excused(where: tuple[str, int, str], tensor) -> str | None:
    file, _, function = where
    if _OPTIM in file and torch.is_tensor(tensor) and tensor.dim() == 0:
        return "torch.optim's host step counter"
    if file.endswith(os.path.join("engines", "step.py")) and function == "_every_grad_nonzero":
        return "stage 0 on the CPU: the reduced gradient tells the used parameters"
    return None


class CountReads:
    """Counts value reads while active: ``reads`` (file, line, function, name) not excused,
    ``agreement`` (ZeRO-3's checksum before backward), ``excused`` (reason -> count)."""

    def __init__(self):
        self.reads, self.agreement, self.excused = [], [], {}
        self._lock = threading.Lock()
        self._saved = []

    def _record(self, name: str, tensor) -> None:
        where = _caller()
        with self._lock:
            reason = _excused(where, tensor)
            if reason is not None:
                self.excused[reason] = self.excused.get(reason, 0) + 1
            elif where[0].endswith("guard.py") and where[2] == "result":
                self.agreement.append((*where, name))
            else:
                self.reads.append((*where, name))

    def __enter__(self):
        def wrap(name, original):
            def counted(*args, **kwargs):
                if _reads_value(name, args, kwargs):
                    self._record(name, args[0] if args else None)
                return original(*args, **kwargs)
            return counted

        for owner, names in ((torch.Tensor, READS), (torch, FUNCTIONS)):
            for name in names:
                self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
                setattr(owner, name, wrap(name, getattr(owner, name)))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            if original is _MISSING:
                delattr(owner, name)  # inherited from Tensor's C base again
            else:
                setattr(owner, name, original)
        self._saved = []


_MISSING = object()


def steps_without_reads(stages=STAGES, configs=CONFIGS, flags_from_grads: bool | None = None,
                        steps: int = 3, overflow_at: int | None = 1, multi: str | None = None,
                        debug: bool = False) -> list[dict]:
    """On every rank: per (stage, config), ``steps`` steps of small_gpt, reads counted inside
    forward, ``engine.backward`` and ``engine.step``. ``debug``: debug mode on.
    ``overflow_at``: in that step an inf in one gradient (rank 0's) makes fp16 and clipping
    runs skip it. ``multi``: force the multi-tensor step (``"fused"``: CUDA's choice) on the
    CPU. Returns per run the reads, the agreement reads, the excused counts and whether each
    step stepped (read after it)."""
    from zerolearn import comm, data
    from zerolearn import dist as zdist
    from zerolearn.engines import make_engine

    ctx = zdist.context()
    out = []
    comm.set_debug(debug)
    for stage in stages:
        for name, options, micro, quiet in configs:
            engine = make_engine(stage, small_gpt(0), optimizer="adam", lr=1e-2, bucket_mb=0.01, **options)
            if flags_from_grads is not None:
                engine.flags_from_grads = flags_from_grads
            if multi is not None:
                engine.optimizer.multi = multi
            counter, stepped = CountReads(), []
            param = engine.model.blocks[0].fc.weight
            for step in range(steps):
                x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in global_batch(step))
                poison = step == overflow_at and ctx.rank == 0 and (options.get("dtype") == "fp16"
                                                                   or "max_grad_norm" in options)
                handle = param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))) \
                    if poison else None
                for k in range(micro):
                    xs, ys = x.chunk(micro)[k], y.chunk(micro)[k]
                    with counter:
                        logits = engine(xs)
                    loss = gpt_loss(logits, ys) / micro
                    silent = engine.no_sync() if k < quiet else contextlib.nullcontext()
                    with silent, counter:
                        engine.backward(loss)
                if handle is not None:
                    handle.remove()
                with counter:
                    result = engine.step()
                stepped.append(bool(result))  # the caller's one read, after the step
                engine.zero_grad()
            out.append({"stage": stage, "config": name, "reads": counter.reads, "agreement": len(counter.agreement),
                        "excused": counter.excused, "stepped": stepped})
            engine.close()
    comm.set_debug(False)
    return out


def _check(runs: list[dict], world_size: int) -> None:
    for run in runs:
        where = f"stage {run['stage']}, {run['config']}, {world_size} rank(s)"
        assert run["reads"] == [], f"{where}: host reads inside forward/backward/step: {run['reads'][:5]}"
        poisoned = run["config"] in ("fp16", "clip", "fp16+clip")
        if poisoned:
            assert run["stepped"][1] is False, f"{where}: the overflowed step was not skipped: {run['stepped']}"
        else:
            assert all(run["stepped"]), where
        # No agreement exchange read by default, at any stage and world size
        assert run["agreement"] == 0, f"{where}: {run['agreement']} agreement reads"


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_value_read_inside_backward_or_step(world_size):
    results = on_ranks(steps_without_reads, world_size)
    assert len(results) == world_size
    for runs in results:
        assert len(runs) == len(STAGES) * len(CONFIGS)
        _check(runs, world_size)


def test_stage_0_as_on_an_accelerator_reads_nothing_at_all():
    # The accelerator's choice (flags exchanged, the reduced gradient not looked at), run on the CPU.
    results = on_ranks(steps_without_reads, 2, stages=(0,), flags_from_grads=False)
    assert len(results) == 2
    for runs in results:
        assert len(runs) == len(CONFIGS)
        _check(runs, 2)
        assert all(not run["excused"].get("stage 0 on the CPU: the reduced gradient tells the used parameters")
                   for run in runs)


def test_the_counter_sees_reads_inside_autograd_hooks():
    t = torch.ones(3, requires_grad=True)
    t.register_hook(lambda g: (g.sum().item(), g)[1])
    with CountReads() as counter:
        (t * 2).sum().backward()
        bool(torch.tensor(1.0))
    assert [r[-1] for r in counter.reads] == ["item", "__bool__"]
    assert torch.tensor(2.0).item() == 2.0  # methods restored
    assert "item" not in torch.Tensor.__dict__ and "__bool__" not in torch.Tensor.__dict__


def test_the_fused_multi_tensor_step_reads_nothing_either():
    # CUDA's one fused step over all masters (optim.multi_tensor_kind), forced on the CPU, fp32 runs.
    fp32 = [c for c in CONFIGS if c[1].get("dtype") is None]
    assert fp32
    results = on_ranks(steps_without_reads, 2, configs=fp32, flags_from_grads=False, multi="fused")
    assert len(results) == 2
    for runs in results:
        assert len(runs) == len(STAGES) * len(fp32)
        _check(runs, 2)


def test_zero_3_agreement_checks_run_in_debug_mode_only():
    # Debug mode (ZEROLEARN_DEBUG_COLLECTIVES=1): every forward agrees on each unit and its end,
    # every backward on the units that get gradients; outside it, nothing (the test above).
    # (a proposal read inside forward is seen through the debug read guard, so only the backward's
    # are sure to be counted as agreement: at least one per step)
    runs = on_ranks(steps_without_reads, 2, stages=(3,), configs=CONFIGS[:1], debug=True)[0]
    assert len(runs) == 1 and runs[0]["agreement"] >= 3, runs[0]["agreement"]
