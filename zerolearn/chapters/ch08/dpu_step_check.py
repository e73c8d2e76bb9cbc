"""Exercise ``08.dpu_step``'s check: ZeRO-Offload's delayed parameter update (Ren et al., arXiv 2101.06840).

The trial trains a quadratic loss over 1,000 parameters (its target moved a little by
each step's batch, so that no two steps' gradients are equal) with Adam on the "host" for 7
steps, calling the reader's ``dpu_step`` at the end of each. It owns the two things
the reader's function drives: ``host_step`` (Adam on the fp32 master copy) and the
``worker``. The worker is deterministic where a thread pool is not: ``submit`` starts
the update on a real thread and returns once the update has written the first half of
``master`` and paused; the second half is written when the future's ``result()`` is
called (or when the next update must start, as a single worker thread would run them
in order). So an update that was not waited for is seen, every time, as a master
copy torn in half, the race a real CPU step makes one time in many. The future is a
``concurrent.futures.Future`` (``done()``, ``result()``, ``exception()``, callbacks);
its ``done()`` says False while the update is paused, until polled for a while.

Before each forward the trial reads the published parameters and names which update
they hold against what DPU promises: step 0 synchronous, then one step behind (the
forward of step t reads the update of step t - 2's gradient). It also checks that
each update got its own step's gradient and was still running when ``dpu_step``
returned (overlap), that what it returned is that update's future (the next call waits
for it), and that ``params`` still has memory of its own, not ``master``'s, in this
process (no ranks).

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch08.dpu_step`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import torch

from zerolearn.chapters.ch08.dpu_step import dpu_step
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, first_difference, register

N, STEPS, LR = 1000, 7, 0.05
HALF = N // 2
_JOB = threading.local()  # on a worker thread: the job it runs


POLLED_S = 0.2  # seconds of done() answering False after which the paused update finishes


class _Job(Future):
    """One update on its own thread, a ``concurrent.futures.Future``: ``result()`` (and
    ``exception()``) let it finish and wait for it; ``done()`` answers without waiting, False
    while it is paused, until it has been asked for :data:`POLLED_S` seconds (a loop that polls
    it sees it finish, as it would a real CPU step)."""

    def __init__(self, fn, args):
        super().__init__()
        self.midway, self.release = threading.Event(), threading.Event()
        self.asked: float | None = None
        self.set_running_or_notify_cancel()
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()
        while not (self.midway.wait(0.01) or super().done()):  # until it has written half, or finished
            pass

    def _run(self, fn, args) -> None:
        _JOB.job = self
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            self.set_exception(e)
        else:
            self.set_result(value)

    def pause(self) -> None:
        self.midway.set()
        self.release.wait(30)

    def result(self, timeout=None):
        self.release.set()
        return super().result(timeout)

    def exception(self, timeout=None):
        self.release.set()
        return super().exception(timeout)

    def done(self) -> bool:
        if not super().done():
            now = time.monotonic()
            self.asked = now if self.asked is None else self.asked
            if now - self.asked > POLLED_S:
                self.release.set()
        return super().done()


class _HostWorker:
    """``concurrent.futures``-like, one update at a time: ``submit`` first finishes the update
    still running (a single worker thread runs them in order), then starts the new one."""

    def __init__(self):
        self.jobs: list[_Job] = []

    def submit(self, fn, *args) -> _Job:
        for job in self.jobs:
            if job.running():
                job.result()
        self.jobs.append(_Job(fn, args))
        return self.jobs[-1]

    def running(self) -> bool:
        return any(job.running() for job in self.jobs)

    def in_flight(self) -> _Job | None:
        """The update still running, if any."""
        return next((job for job in self.jobs if job.running()), None)

    def close(self) -> None:
        for job in self.jobs:
            job.release.set()
            job.thread.join(30)


class _HostAdam:
    """Adam (torch's defaults, lr ``LR``) on ``master`` in place; keeps every finished master
    (``history[k]``: after k updates) and which step's gradient each update got."""

    def __init__(self, master: torch.Tensor, grads: list):
        self.master, self.grads = master, grads
        self.m, self.v, self.t = torch.zeros_like(master), torch.zeros_like(master), 0
        self.history, self.got, self.in_flight = [master.clone()], [], None

    def __call__(self, grad: torch.Tensor) -> None:
        self.got.append(next((s for s, g in enumerate(self.grads) if torch.equal(g, grad)), None))
        self.t += 1
        self.m.mul_(0.9).add_(grad, alpha=0.1)
        self.v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        m_hat, v_hat = self.m / (1 - 0.9 ** self.t), self.v / (1 - 0.999 ** self.t)
        new = self.master - LR * m_hat / (v_hat.sqrt() + 1e-8)
        self.in_flight = new
        self.master[:HALF] = new[:HALF]
        job = getattr(_JOB, "job", None)
        if job is not None:
            job.pause()  # the CPU is still busy with the rest: the second half is not written yet
        self.master[HALF:] = new[HALF:]
        self.history.append(self.master.clone())
        self.in_flight = None


def _expected_updates(step: int) -> int:
    """How many updates the forward of ``step`` reads under DPU: all before step 2, then one fewer."""
    return step if step <= 1 else step - 1


def _name_what_it_read(step: int, seen: torch.Tensor, adam: _HostAdam) -> None:
    """Raise Wrong naming which update the parameters read by the forward of ``step`` hold."""
    want = _expected_updates(step)
    if want < len(adam.history) and torch.equal(seen, adam.history[want]):
        return
    for k, m in enumerate(adam.history):
        if torch.equal(seen, m):
            if step == 1 and k == 0:
                raise Wrong("the forward of step 1 reads the initial parameters: step 0 runs synchronously "
                            "(the warm-up: apply its update and publish it before returning)", step)
            if k > want:
                raise Wrong(f"the forward of step {step} reads the parameters updated with step {k - 1}'s "
                            f"gradient: no delay, the device waited for the CPU's step. DPU's forward of step "
                            f"{step} reads the update of step {want - 1}'s gradient while step {step - 1}'s "
                            "still runs on the worker", step)
            raise Wrong(f"the forward of step {step} reads the parameters after {k} update{'s' * (k != 1)}; DPU "
                        f"gives it {want} (through step {want - 1}'s gradient): {want - k + 1} steps of delay "
                        "instead of one. Publish master right after waiting for the update in flight", step)
    newer = adam.in_flight
    for k in range(1, len(adam.history) + 1):
        first = newer if k == len(adam.history) else adam.history[k]
        if first is not None and torch.equal(seen[:HALF], first[:HALF]) and \
                torch.equal(seen[HALF:], adam.history[k - 1][HALF:]):
            raise Wrong(f"the forward of step {step} reads a torn master copy: its first half holds update {k}, "
                        f"its second half update {k - 1}. master was published while that update was still "
                        "running on the worker: wait for pending (pending.result()) before copying master", step)
    first_difference(f"the parameters the forward of step {step} reads", seen, adam.history[min(want, len(
        adam.history) - 1)], step=step, rtol=0, atol=0, reference="DPU")


def _after_call(step: int, returned, params: torch.Tensor, master: torch.Tensor, adam: _HostAdam,
                worker: _HostWorker) -> None:
    """What must hold when ``dpu_step`` returns at ``step``; raises Wrong naming what does not."""
    if params.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
        raise Wrong(f"after dpu_step at step {step}, params shares its memory with master (params.set_(master), "
                    "params.data = master): the update running on the worker then writes into the parameters the "
                    "device reads. Publish a copy into params' own memory: params.copy_(master)", step)
    started = len(adam.got)
    if started < step + 1:
        raise Wrong(f"dpu_step returned without starting the update of step {step}'s gradient "
                    f"({started} updates started, {step + 1} expected): submit host_step(grad)", step)
    if started > step + 1:
        raise Wrong(f"{started} updates started after step {step}, {step + 1} expected: one host_step per step", step)
    if adam.got[step] != step:
        raise Wrong(f"update {step} got {'no step' if adam.got[step] is None else f'step {adam.got[step]}'}"
                    f"'s gradient: each update applies the gradient of its own step", step)
    running = worker.in_flight()
    if step >= 1 and running is None:
        raise Wrong(f"the update of step {step}'s gradient had finished when dpu_step returned: no overlap, the "
                    "device waited for the CPU (a synchronous step). Start it on the worker and return its future "
                    "without waiting", step)
    if step == 0 and running is not None:
        raise Wrong("step 0's update was still running when dpu_step returned: step 0 runs synchronously (the "
                    "warm-up)", step)
    if running is not None and returned is not running:
        what = "None" if returned is None else f"a {type(returned).__name__}"
        raise Wrong(f"dpu_step returned {what} at step {step}, not the future of the update it started, which "
                    "still runs: the next call gets what you return as pending and can wait only for that. Return "
                    "the future worker.submit gave you", step)


def _dpu_trial(fn) -> str:
    """7 steps of a quadratic loss under DPU; see the module docstring for what is checked."""
    g = torch.Generator().manual_seed(8)
    target, weight = torch.randn(N, generator=g), torch.rand(N, generator=g) + 0.5
    batches = [0.1 * torch.randn(N, generator=g) for _ in range(STEPS)]  # each step's own batch
    params = torch.zeros(N)
    master = params.clone()
    grads: list[torch.Tensor] = []
    adam, worker = _HostAdam(master, grads), _HostWorker()
    pending = None
    try:
        for step in range(STEPS):
            seen = params.clone()
            _name_what_it_read(step, seen, adam)
            grads.append(weight * (seen - target - batches[step]))
            pending = fn(step, params, master, grads[-1].clone(), adam, pending, worker)
            _after_call(step, pending, params, master, adam, worker)
    finally:
        worker.close()
    return (f"{STEPS} steps: step 0 synchronous, then every forward read the update of the gradient two steps "
            "before it, each host update running while the next step computed")


_publish_before_wait = edited(dpu_step, {
    "    if pending is not None:\n"
    "        pending.result()  # the previous step's update must be whole before anyone reads master\n"
    "    params.copy_(master)  # the device now holds the update of step - 1's gradient\n":
    "    params.copy_(master)\n    if pending is not None:\n        pending.result()\n"},
    name="_publish_before_wait",
    doc="""The publication and the wait swapped: master is copied while the previous update may
    still be writing it (a race: a torn copy, some elements updated, some not).""")


def _no_delay(step, params, master, grad, host_step, pending, worker):
    """A plain synchronous step on the host: correct, but the device waits for the CPU (no DPU)."""
    host_step(grad)
    params.copy_(master)
    return None


_STAGED: dict[str, torch.Tensor] = {}


_two_steps_late = edited(dpu_step, {
    "        params.copy_(master)\n        return None\n":
    "        params.copy_(master)\n        _STAGED[\"copy\"] = master.clone()\n        return None\n",
    "    params.copy_(master)  # the device now holds the update of step - 1's gradient\n":
    "    params.copy_(_STAGED[\"copy\"])\n    _STAGED[\"copy\"] = master.clone()\n"},
    name="_two_steps_late", names={"_STAGED": _STAGED},
    doc="""A staging buffer published one call late: the device reads the master copied at the
    previous step, two updates behind instead of one.""")

_first_step_async = edited(dpu_step, {
    "    if step == 0:  # warm-up: the first update is applied before the next forward\n"
    "        host_step(grad)\n        params.copy_(master)\n        return None\n": ""},
    name="_first_step_async",
    doc="""DPU from the very first step: the warm-up forgotten, so step 1 computes on the initial
    parameters.""")

_future_not_returned = edited(dpu_step, {
    "    return worker.submit(host_step, grad)  # this step's update runs while the device computes the next\n":
    "    worker.submit(host_step, grad)\n    return None\n"},
    name="_future_not_returned",
    doc="""The update started on the worker but its future dropped: the next call gets None as
    pending, has nothing to wait for, and copies master while the update still writes it.""")

_aliases_master = edited(dpu_step, {
    "        params.copy_(master)\n        return None\n": "        params.set_(master)\n        return None\n",
    "    params.copy_(master)  # the device now holds": "    params.set_(master)  # the device now holds"},
    name="_aliases_master",
    doc="""params made a view of master's memory instead of a copy of it: the update running on the
    worker writes into what the device reads.""")


register(Exercise(
    "08.dpu_step", "ZeRO-Offload's delayed parameter update: publish the last update, start this one",
    dpu_step, _dpu_trial,
    {"publish_before_wait": Bug(_publish_before_wait, "a race between the CPU step and the copy", "torn"),
     "no_delay": Bug(_no_delay, "a synchronous host step", "no overlap"),
     "two_steps_late": Bug(_two_steps_late, "a staging buffer published one call late", "2 steps of delay"),
     "first_step_async": Bug(_first_step_async, "DPU without the warm-up step", "step 0 runs synchronously"),
     "future_not_returned": Bug(_future_not_returned, "the update's future dropped: the next call cannot wait",
                                "Return the future worker.submit gave you"),
     "aliases_master": Bug(_aliases_master, "params.set_(master): the device reads the memory the worker writes",
                           "params shares its memory with master")},
    world_sizes=()))
