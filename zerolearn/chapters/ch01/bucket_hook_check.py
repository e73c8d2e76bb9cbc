"""Exercise ``01.bucket_hook``'s check: bucketed gradient averaging from autograd hooks (paper Sec 5.2, 7.1).

The same mean as ``01.average_gradients``, in buckets launched from
post-accumulate-grad hooks while backward runs, as DDP and the book's engines do (the
scheme Sec 5.2 builds on). The trial trains a small GPT with Adam for three steps
against one process on the whole batch and checks, per step, that there is one
all-reduce per bucket, all launched during backward, every gradient after
``finish()`` and every parameter after the step, and 2 Psi moved.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch01.bucket_hook`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolearn import comm, flat
from zerolearn import dist as zdist
from zerolearn.chapters.ch01.bucket_hook import bucket_hook
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, register
from zerolearn.exercises.helpers import (
    ADAM_LR,
    batches,
    compare_grad,
    compare_params,
    gpt_pair,
    loss_of,
    psi_per_step,
    reference_grads,
    settled,
)
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.tables import kib

STEPS = 3
BUCKET_BYTES = 48 * 1024  # 5 buckets for the trials' GPT
GROWTH_SLACK = 1024  # bytes: what the hooks keep may differ this much between steps, not grow step after step


def _one_per_bucket(during: int, calls: int, moved: int, n: int, step: int) -> None:
    """One all-reduce per bucket in the step (``calls`` of them, ``during`` backward; ``moved``
    elements), each launched during backward; raises Wrong naming what differs."""
    if moved == 0 and step > 0:
        raise Wrong(f"no all_reduce ran in this step, though step 0 made {n}: your hooks stopped launching "
                    "after the first backward; reset what counts a bucket's arrived gradients when the "
                    "bucket launches (the hooks stay registered and run again every backward)", step)
    if moved == 0:
        raise Wrong("no collective ran in this step: launch each bucket's dist.all_reduce(buffer, async_op=True) "
                    "from the hook of its last gradient", step)
    if calls != n:
        raise Wrong(f"you made {calls} all_reduce calls in one step; the {n} buckets need {n} collectives, "
                    "one per bucket: every call pays a collective's start-up latency, however small its "
                    "tensor", step)
    if during != n:
        raise Wrong(f"{n - during} of the {n} buckets were not launched during backward: launch each "
                    "bucket from the hook of its last gradient, so that it travels while backward "
                    "computes the earlier layers (Sec 5.2)" if during else
                    f"no all_reduce was launched during backward: all {n} ran in finish(), after it; "
                    "launch each bucket from the hook of its last gradient (Sec 5.2)", step)


def _bucket_trial(fn) -> str:
    """Three Adam steps with the reader's hooks against one process on the whole batch: how
    many all-reduces ran during backward and in all (one per bucket), 2 Psi per step, every
    gradient after ``finish()`` and every parameter after the step."""
    world_size = zdist.context().world_size
    model, ref = gpt_pair()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR), torch.optim.Adam(ref.parameters(), lr=ADAM_LR)
    psi = sum(p.numel() for p in model.parameters())
    # Backward finishes the last layers first: buckets follow the parameters in reverse.
    groups = flat.buckets(list(reversed(list(model.named_parameters()))), BUCKET_BYTES, 4)
    n = len(groups)
    finish = fn([[p for _, p in g] for g in groups], world_size)
    if not callable(finish):
        raise Wrong(f"bucket_hook returned {type(finish).__name__}; it must return finish(), a function "
                    "the caller runs after loss.backward()")
    ledgers, kept = [], []  # a memory ledger per step's backward and finish(); bytes they left alive
    for step in range(STEPS):
        local = reference_grads(ref, step)
        (x, y), _ = batches(step)
        comm.LEDGER.reset()
        with MemoryLedger(record_timeline=False) as ledger:
            loss_of(model, x, y).backward()
            during = comm.LEDGER.as_dict()["all_reduce"]["calls"]
            finish()
        ledgers.append(ledger)
        moved = comm.LEDGER.volume_elements()
        _one_per_bucket(during, comm.LEDGER.as_dict()["all_reduce"]["calls"], moved, n, step)
        for (name, p), q, g in zip(model.named_parameters(), ref.parameters(), local, strict=True):
            compare_grad(f"the gradient of {name!r}", p.grad, q.grad, g, p, world_size, step)
        if moved != 2 * psi:
            raise Wrong(f"you moved {psi_per_step(moved, psi)} per step; DP moves 2.0 Psi "
                        "(one all-reduce of every gradient, Sec 7.1)", step)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        compare_params(model, ref, step)
        # gradients are gone: what the hooks keep (once gloo has let go of the buffers it reduced)
        kept.append(settled(lambda leds=ledgers: sum(sum(led.live.values()) for led in leds),
                            lambda k, first=kept[:1]: not first or k <= first[0] + GROWTH_SLACK))
        if step > 0 and kept[-1] > kept[0] + GROWTH_SLACK:
            raise Wrong("what your hooks keep grows step after step: "
                        f"{', '.join(kib(k, unit=True) for k in kept)} after steps 0 to {step}, allocated during "
                        "backward and finish() and still referenced: let each step's buffers and handles go in "
                        "finish() (clear the list of launched all-reduces), or every step waits on and holds all "
                        "the earlier ones too", step)
        agree(step)
    return (f"every gradient and parameter equals single-process Adam for {STEPS} steps; {n} all_reduce calls "
            f"per step, all launched during backward; 2.0 Psi per step")


_hook_reduces_the_parameter = edited(
    bucket_hook, {"q.grad.flatten()": "q.detach().flatten()", "q.grad.copy_(": "q.data.copy_("},
    name="_hook_reduces_the_parameter",
    doc="""huggingface/picotron issue #39, bucketed: the hook's argument is taken for the
    gradient, so the weights are averaged and the gradients stay this rank's own.""")

_bucket_sum_not_mean = edited(
    bucket_hook, {"            buffer.div_(world_size)\n": ""}, name="_bucket_sum_not_mean",
    doc="The bucketed reduction without the division by Nd (the sum reaches the optimizer).")


def _one_per_tensor(buckets, world_size):
    """Overlapped but unbucketed: each hook launches its own tensor's all-reduce (the first
    version of DDP in CS336's assignment 2, before buckets), one collective per tensor."""
    in_flight = []

    def hook(p):
        in_flight.append((dist.all_reduce(p.grad, async_op=True), p))

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle, p in in_flight:
            handle.wait()
            p.grad.div_(world_size)
        in_flight.clear()

    return finish


def _after_backward(buckets, world_size):
    """Buckets, but reduced only after backward has finished (no hooks): the seed blog's
    and many tutorials' DP, which leaves no communication to overlap with compute."""

    def finish():
        for bucket in buckets:
            buffer = torch.cat([q.grad.flatten() for q in bucket])
            dist.all_reduce(buffer)
            buffer.div_(world_size)
            offset = 0
            for q in bucket:
                q.grad.copy_(buffer[offset:offset + q.numel()].view_as(q))
                offset += q.numel()

    return finish


_counter_never_reset = edited(
    bucket_hook, {"            arrived[i] = 0\n": ""}, name="_counter_never_reset",
    doc="""The reference hooks without ``arrived[i] = 0``: after the first backward no count equals its
    bucket's size again, so no bucket launches from the second step on.""")

_never_cleared = edited(
    bucket_hook, {"        in_flight.clear()\n": ""}, name="_never_cleared",
    doc="""The reference hooks without ``in_flight.clear()``: every finish() waits on and copies back every
    earlier step's buckets too (the last copy wins, so the gradients are right) and keeps their buffers.""")


_divides_before_wait = edited(bucket_hook, {
    "            handle.wait()\n            buffer.div_(world_size)\n":
    "            buffer.div_(world_size)  # meant to overlap with the reduction\n            handle.wait()\n"},
    name="_divides_before_wait",
    doc="The bucket divided by world_size before its all-reduce's handle is waited for: the backend's thread "
        "may still be summing into it.")

register(Exercise(
    "01.bucket_hook", "Bucketed gradient averaging from autograd hooks, overlapped with backward",
    bucket_hook, _bucket_trial,
    {"hook_reduces_the_parameter": Bug(_hook_reduces_the_parameter, "huggingface/picotron issue #39",
                                       "not averaged over the ranks"),
     "no_divide": Bug(_bucket_sum_not_mean, "hand-written DP loops", "not their mean"),
     "one_per_tensor": Bug(_one_per_tensor, "per-tensor overlapped DP (CS336 assignment 2, before buckets)",
                           "one per bucket"),
     "after_backward": Bug(_after_backward, "seed blog 002 and tutorials: reduce after backward",
                           "launched during backward"),
     "counter_never_reset": Bug(_counter_never_reset, "a per-bucket count of arrived gradients never set back to "
                                "0: right in the first step only", "stopped launching"),
     "never_cleared": Bug(_never_cleared, "the list of launched all-reduces never cleared: stale handles "
                          "re-waited, stale buffers kept, every step", "grows step after step"),
     "divides_before_wait": Bug(_divides_before_wait, "an async all-reduce's output divided before its wait(): "
                                "right on an idle machine, a partial sum under load", "before its handle's .wait()")},
    async_reads=True))
