"""Chapter 01's exercises: data parallelism on real ranks (paper Sec 2.1, Sec 7.1).

* ``01.average_gradients``: after backward, replace every gradient by its mean over
  the ranks, one all-reduce per tensor (naive DP).
* ``01.bucket_hook``: the same mean, in buckets launched from autograd hooks while
  backward runs, as DDP and the book's engines do (the scheme Sec 5.2 builds on).

Both trials train a small GPT with Adam for three steps on this rank's slice of each
global batch, beside the same GPT trained in this process on the whole batch, and
compare every gradient and parameter, then the collectives booked by ``comm.LEDGER``.
The helpers here (model, batches, the gradient diagnosis) serve chapter 02 too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data, flat
from zerolearn import dist as zdist
from zerolearn.exercises.core import Bug, Exercise, Wrong, first_difference, register
from zerolearn.models import GPTConfig, build_model

GPT = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
"""The trials' model: Psi = 42,368 parameters in 29 tensors (Nd = 3 leaves a remainder)."""
BATCH, LR, STEPS = 12, 1e-3, 3  # 12 sequences per global batch: 6 per rank on 2, 4 on 3
RTOL, ATOL = 1e-5, 1e-6  # gradients: sums over ranks add in another order than one process does
# Parameters: Adam divides by sqrt(v) + eps, so a gradient that is rounding noise (the key
# projection's bias gets zero in exact arithmetic: softmax ignores a constant added to every
# key) moves by up to lr * noise / eps, about 1e-5 here, whatever the order of the sum.
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5
BUCKET_BYTES = 48 * 1024  # 01.bucket_hook: 5 buckets for this GPT


# ----- shared by the trials of chapters 01 and 02 --------------------------------------

def gpt_pair() -> tuple[nn.Module, nn.Module]:
    """Two identical GPTs (same seed): the rank's replica and the single-process reference."""
    return build_model("gpt", 0, gpt=GPT), build_model("gpt", 0, gpt=GPT)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``model`` on inputs ``x`` and targets ``y`` (b, s)."""
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def batches(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((x, y) of this rank, (x, y) of the whole global batch)`` for ``step``."""
    ctx = zdist.context()
    x, y = data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)
    return (data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)), (x, y)


def reference_grads(ref: nn.Module, step: int) -> list[torch.Tensor]:
    """Leave the global batch's gradient in ``ref``'s ``.grad``; return ``ref``'s gradient
    on this rank's slice alone (what a rank holds before any averaging)."""
    (x, y), (gx, gy) = batches(step)
    params = list(ref.parameters())
    local = torch.autograd.grad(loss_of(ref, x, y), params)
    loss_of(ref, gx, gy).backward()
    return list(local)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def compare_grad(what: str, got, want: torch.Tensor, local: torch.Tensor, param: torch.Tensor,
                 world_size: int, step: int) -> None:
    """Raise :class:`Wrong` when gradient ``got`` is not ``want``, naming what it is instead
    when it is one of the known mistakes: this rank's own gradient, the sum, the mean
    divided twice, or the parameter's values."""
    if got is None:
        raise Wrong(f"{what} is None: your function must leave the averaged gradient in .grad", step)
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not _close(got, want):
        if _close(got, local):
            raise Wrong(f"{what} is still this rank's own gradient: it was not averaged over the ranks "
                        "(a parameter and its .grad are two tensors: reduce p.grad; a post-accumulate-grad "
                        "hook receives the parameter p, not its gradient)", step)
        if _close(got, param.detach()):
            raise Wrong(f"{what} holds the parameter's values, not its gradient: a post-accumulate-grad hook "
                        "receives the parameter p; its gradient is p.grad", step)
        if _close(got, want * world_size):
            raise Wrong(f"{what} is the sum over the {world_size} ranks, not their mean: divide by "
                        "world_size once", step)
        if _close(got, want / world_size):
            raise Wrong(f"{what} is the mean divided by world_size once more: you divided twice", step)
    first_difference(what, got, want, step=step, rtol=RTOL, atol=ATOL)


def compare_params(model: nn.Module, ref: nn.Module, step: int, rtol: float = PARAM_RTOL,
                   atol: float = PARAM_ATOL) -> None:
    """Every parameter of ``model`` against ``ref`` after ``step``'s optimizer step."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        first_difference(f"parameter {name!r} after the optimizer step", p, q, step=step, rtol=rtol, atol=atol)


def psi_per_step(elements: int, psi: int) -> str:
    """Elements moved in one step as a multiple of Psi, to the tenth the paper states (2.0, 3.0)."""
    return f"{elements / psi:.1f} Psi"


# ----- 01.average_gradients --------------------------------------------------------------

def average_gradients(model, world_size):
    """Average every gradient of ``model`` over the ranks, in place, after ``loss.backward()``.

    Args:
        model: an ``nn.Module``, the same on every rank; each trainable parameter ``p``
            holds in ``p.grad`` the gradient of this rank's loss (fp32, shaped as ``p``).
        world_size: the number of ranks, Nd.

    On return every ``p.grad`` holds the mean of the ranks' gradients: the gradient of
    the whole global batch. Use ``comm.all_reduce(tensor)`` (it sums in place over the
    ranks and books the elements it moves in ``comm.LEDGER``). Leave the parameters alone.
    """
    # BEGIN SOLUTION
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad)  # the sum over ranks, on every rank
            p.grad.div_(world_size)
    # END SOLUTION


def _average_trial(fn) -> str:
    """Three Adam steps of a GPT on this rank's slice against one process on the whole batch:
    every gradient after ``fn``, every parameter after the step, and 2 Psi per step."""
    world_size = zdist.context().world_size
    model, ref = gpt_pair()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=LR), torch.optim.Adam(ref.parameters(), lr=LR)
    psi = sum(p.numel() for p in model.parameters())
    for step in range(STEPS):
        local = reference_grads(ref, step)
        (x, y), _ = batches(step)
        loss_of(model, x, y).backward()
        comm.LEDGER.reset()
        fn(model, world_size)
        for (name, p), q, g in zip(model.named_parameters(), ref.parameters(), local):
            compare_grad(f"the gradient of {name!r}", p.grad, q.grad, g, p, world_size, step)
        moved = comm.LEDGER.volume_elements()
        if moved == 0:
            raise Wrong("comm.LEDGER saw no collective: call comm.all_reduce (it books what moves), "
                        "not dist.all_reduce", step)
        if moved != 2 * psi:
            raise Wrong(f"you moved {psi_per_step(moved, psi)} per step; averaging the gradients moves 2.0 Psi "
                        "(one all-reduce of every gradient, Sec 7.1)", step)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        compare_params(model, ref, step)
    calls = comm.LEDGER.as_dict()["all_reduce"]["calls"]
    return (f"every gradient and parameter equals single-process Adam on the global batch for {STEPS} steps; "
            f"2.0 Psi per step in {calls} all_reduce calls")


def _average_the_weights(model, world_size):
    """huggingface/picotron issue #39: the reduction is applied to the parameter, not to
    its gradient, so the (identical) weights are averaged and the gradients never are."""
    for p in model.parameters():
        comm.all_reduce(p.data)
        p.data.div_(world_size)


def _sum_not_mean(model, world_size):
    """The division by Nd forgotten: every rank steps with Nd times the gradient (a common
    slip in hand-written DP; Adam hides it, SGD does not)."""
    for p in model.parameters():
        comm.all_reduce(p.grad)


def _divide_twice(model, world_size):
    """Nd divided out twice, e.g. once by the loss (``loss / world_size``) and once after the
    all-reduce, as when code written for a summed loss meets a mean loss."""
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad.div_(world_size)
        p.grad.div_(world_size)


register(Exercise(
    "01.average_gradients", "Naive data parallelism: average every gradient over the ranks",
    average_gradients, _average_trial,
    {"weights_not_grads": Bug(_average_the_weights, "huggingface/picotron issue #39", "not averaged over the ranks"),
     "no_divide": Bug(_sum_not_mean, "hand-written DP loops", "not their mean"),
     "divide_twice": Bug(_divide_twice, "a mean loss divided by Nd again", "divided twice")}))


# ----- 01.bucket_hook --------------------------------------------------------------------

def bucket_hook(buckets, world_size):
    """Average gradients in buckets, each launched from an autograd hook during backward.

    Args:
        buckets: the model's trainable parameters (fp32 ``nn.Parameter``), split into a
            list of buckets, each a list of parameters; every parameter is in exactly one.
        world_size: the number of ranks, Nd.

    Register a hook on every parameter with ``p.register_post_accumulate_grad_hook(hook)``;
    autograd calls ``hook(p)`` with the *parameter* once ``p.grad`` is complete. When
    the last gradient of a bucket has arrived, copy the bucket's gradients into one flat
    fp32 buffer and launch ``comm.all_reduce(buffer, async_op=True)`` at once, without
    waiting: it runs while backward goes on. One all-reduce per bucket per step.

    Returns:
        ``finish()``, which the caller runs after ``loss.backward()``: it waits for
        every launched all-reduce (``handle.wait()``), divides by ``world_size`` and
        copies each parameter's averaged gradient back into ``p.grad``. The hooks
        stay registered: the next backward uses them again.
    """
    # BEGIN SOLUTION
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    arrived = [0] * len(buckets)
    in_flight = []  # (handle, flat buffer, bucket), in launch order: the same on every rank

    def hook(p):  # receives the parameter; its gradient is p.grad
        i = bucket_of[id(p)]
        arrived[i] += 1
        if arrived[i] == len(buckets[i]):  # the bucket's last gradient: launch it now
            arrived[i] = 0
            buffer = torch.cat([q.grad.flatten() for q in buckets[i]])
            in_flight.append((comm.all_reduce(buffer, async_op=True), buffer, buckets[i]))

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle, buffer, bucket in in_flight:
            handle.wait()
            buffer.div_(world_size)
            offset = 0
            for q in bucket:
                q.grad.copy_(buffer[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        in_flight.clear()

    return finish
    # END SOLUTION


def _bucket_trial(fn) -> str:
    """Three Adam steps with the reader's hooks against one process on the whole batch: how
    many all-reduces ran during backward and in all (one per bucket), 2 Psi per step, every
    gradient after ``finish()`` and every parameter after the step."""
    world_size = zdist.context().world_size
    model, ref = gpt_pair()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=LR), torch.optim.Adam(ref.parameters(), lr=LR)
    psi = sum(p.numel() for p in model.parameters())
    # Backward finishes the last layers first: buckets follow the parameters in reverse.
    groups = flat.buckets(list(reversed(list(model.named_parameters()))), BUCKET_BYTES, 4)
    n = len(groups)
    finish = fn([[p for _, p in g] for g in groups], world_size)
    if not callable(finish):
        raise Wrong(f"bucket_hook returned {type(finish).__name__}; it must return finish(), a function "
                    "the caller runs after loss.backward()")
    for step in range(STEPS):
        local = reference_grads(ref, step)
        (x, y), _ = batches(step)
        comm.LEDGER.reset()
        loss_of(model, x, y).backward()
        during = comm.LEDGER.as_dict()["all_reduce"]["calls"]
        finish()
        calls, moved = comm.LEDGER.as_dict()["all_reduce"]["calls"], comm.LEDGER.volume_elements()
        if moved == 0:
            raise Wrong("comm.LEDGER saw no collective: call comm.all_reduce (it books what moves), "
                        "not dist.all_reduce", step)
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
        for (name, p), q, g in zip(model.named_parameters(), ref.parameters(), local):
            compare_grad(f"the gradient of {name!r}", p.grad, q.grad, g, p, world_size, step)
        if moved != 2 * psi:
            raise Wrong(f"you moved {psi_per_step(moved, psi)} per step; DP moves 2.0 Psi "
                        "(one all-reduce of every gradient, Sec 7.1)", step)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        compare_params(model, ref, step)
    return (f"every gradient and parameter equals single-process Adam for {STEPS} steps; {n} all_reduce calls "
            f"per step, all launched during backward; 2.0 Psi per step")


def _bucketed(buckets, world_size, *, divide: bool = True, grads: bool = True):
    """The reference bucketing with one mistake switched on: ``divide=False`` leaves the
    sum; ``grads=False`` takes the hook's argument for the gradient, packing the
    parameters' values and writing the averaged values back into the parameters."""
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    got = [[] for _ in buckets]
    in_flight = []

    def hook(p):
        i = bucket_of[id(p)]
        got[i].append(p.grad if grads else p)
        if len(got[i]) == len(buckets[i]):
            tensors, got[i] = got[i], []
            buffer = torch.cat([t.detach().flatten() for t in tensors])
            in_flight.append((comm.all_reduce(buffer, async_op=True), buffer, tensors))

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle, buffer, tensors in in_flight:
            handle.wait()
            if divide:
                buffer.div_(world_size)
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(buffer[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        in_flight.clear()

    return finish


def _hook_reduces_the_parameter(buckets, world_size):
    """huggingface/picotron issue #39, bucketed: the hook's argument is taken for the
    gradient, so the weights are averaged and the gradients stay this rank's own."""
    return _bucketed(buckets, world_size, grads=False)


def _bucket_sum_not_mean(buckets, world_size):
    """The bucketed reduction without the division by Nd (the sum reaches the optimizer)."""
    return _bucketed(buckets, world_size, divide=False)


def _one_per_tensor(buckets, world_size):
    """Overlapped but unbucketed: each hook launches its own tensor's all-reduce (the first
    version of DDP in CS336's assignment 2, before buckets), one collective per tensor."""
    in_flight = []

    def hook(p):
        in_flight.append((comm.all_reduce(p.grad, async_op=True), p))

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
            comm.all_reduce(buffer)
            buffer.div_(world_size)
            offset = 0
            for q in bucket:
                q.grad.copy_(buffer[offset:offset + q.numel()].view_as(q))
                offset += q.numel()

    return finish


register(Exercise(
    "01.bucket_hook", "Bucketed gradient averaging from autograd hooks, overlapped with backward",
    bucket_hook, _bucket_trial,
    {"hook_reduces_the_parameter": Bug(_hook_reduces_the_parameter, "huggingface/picotron issue #39",
                                       "not averaged over the ranks"),
     "no_divide": Bug(_bucket_sum_not_mean, "hand-written DP loops", "not their mean"),
     "one_per_tensor": Bug(_one_per_tensor, "per-tensor overlapped DP (CS336 assignment 2, before buckets)",
                           "one per bucket"),
     "after_backward": Bug(_after_backward, "seed blog 002 and tutorials: reduce after backward",
                           "launched during backward")}))
