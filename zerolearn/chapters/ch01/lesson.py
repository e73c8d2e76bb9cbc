"""Chapter 1, data parallelism from scratch (paper Sec 2.1, Sec 7.1).

What the chapter runs on spawned gloo ranks, and the naive data parallelism it
starts from:

* :func:`collectives` shows all_reduce = reduce_scatter + all_gather on small tensors;
* :func:`naive_dp_step` is data parallelism in its simplest form: after backward,
  one blocking all_reduce per parameter tensor;
* :func:`compare_dp` trains the same GPT with the naive version, with the book's
  bucketed stage-0 engine and with torch's ``DistributedDataParallel``;
* :func:`single_process` is the reference all of them must match.

The chapter's exercises (``01.average_gradients``, ``01.bucket_hook``) are beside this
module, in :mod:`zerolearn.chapters.ch01`.

Every collective goes through :mod:`zerolearn.comm`, so its ledger counts them.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.models import GPTConfig, build_model

GPT = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
"""The chapter's model: Psi = 134,912 parameters in 29 tensors."""
BATCH = 16  # global batch, sequences per step; divisible by 1, 2 and 4 ranks
LR = 1e-3


def collectives(numel: int = 8) -> dict[str, torch.Tensor]:
    """Each rank's tensors before and after all_reduce, reduce_scatter and all_gather.

    Rank r starts from ``grad = [8r, 8r + 1, ..., 8r + numel - 1]`` (a stand-in for its
    gradient). ``all_reduce`` leaves the sum on every rank; ``reduce_scatter`` leaves
    rank r only chunk r of the sum (``numel / world_size`` elements); ``all_gather``
    of those chunks rebuilds the whole sum on every rank: the same result as
    ``all_reduce``, which is how ring all-reduce works (Sec 7.1). ``numel`` must be
    a multiple of the world size.
    """
    ctx = zdist.context()
    grad = torch.arange(numel, dtype=torch.float32) + numel * ctx.rank
    comm.LEDGER.reset()
    summed = grad.clone()
    comm.all_reduce(summed)  # in place: every rank gets the sum
    chunk = torch.empty(numel // ctx.world_size)
    comm.reduce_scatter(chunk, grad.clone())  # rank r gets chunk r of the sum
    gathered = torch.empty(numel)
    comm.all_gather(gathered, chunk)  # every rank gets every chunk
    return {"grad": grad, "all_reduce": summed, "reduce_scatter": chunk, "all_gather": gathered,
            "ledger": comm.LEDGER.as_dict()}


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy; logits (b, s, 256), targets (b, s) int64."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def naive_dp_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor, world_size: int) -> float:
    """One step of naive data parallelism on this rank's slice ``x``, ``y`` of the batch.

    Backward runs to the end, then every parameter's gradient is summed over ranks
    with its own blocking all_reduce and divided by ``world_size``: every rank now
    holds the gradient of the global batch, and the same optimizer step on every
    rank keeps the replicas identical. Correct, but communication waits for the whole
    backward, and a model with many small tensors pays a collective's latency for
    each. Returns this rank's loss.
    """
    loss = gpt_loss(model(x), y)
    loss.backward()
    for p in model.parameters():  # one collective per tensor, after backward
        comm.all_reduce(p.grad)
        p.grad.div_(world_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _batch(step: int, rank: int, world_size: int):
    x, y = data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)
    return data.rank_slice(x, rank, world_size), data.rank_slice(y, rank, world_size)


def compare_dp(steps: int = 5, bucket_mb: float = 0.25) -> dict:
    """Train the same GPT three ways on this rank's slices; losses, ledgers, step times.

    ``naive`` uses :func:`naive_dp_step`; ``engine`` the book's stage-0 engine
    (gradient buckets of at most ``bucket_mb`` MiB reduced from autograd hooks);
    ``torch_ddp`` torch's ``DistributedDataParallel`` (its own buckets and hooks; its
    collectives bypass our ledger). Every model starts from the same seed, fp32
    Adam, ``lr = LR``. Losses are global means over ranks.
    """
    from torch.nn.parallel import DistributedDataParallel

    ctx = zdist.context()
    out = {}
    for kind in ("naive", "engine", "torch_ddp"):
        model = build_model("gpt", 0, gpt=GPT)
        if kind == "engine":
            engine = make_engine(0, model, optimizer="adam", lr=LR, bucket_mb=bucket_mb)
        else:
            wrapped = DistributedDataParallel(model) if kind == "torch_ddp" else model
            optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        comm.LEDGER.reset()
        losses, seconds = [], []
        for step in range(steps):
            x, y = _batch(step, ctx.rank, ctx.world_size)
            t0 = time.perf_counter()
            if kind == "naive":
                loss = naive_dp_step(model, optimizer, x, y, ctx.world_size)
            elif kind == "engine":
                loss_t = gpt_loss(engine(x), y)
                engine.backward(loss_t)  # buckets are all-reduced from hooks during backward
                engine.step()
                engine.zero_grad()
                loss = loss_t.item()
            else:
                loss_t = gpt_loss(wrapped(x), y)
                loss_t.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loss = loss_t.item()
            seconds.append(time.perf_counter() - t0)
            losses.append(comm.monitor_mean(loss))
        out[kind] = {"losses": losses, "ledger": comm.LEDGER.as_dict(),
                     "step_seconds_median": statistics.median(seconds[1:] or seconds),
                     "buckets": len(engine.buckets) if kind == "engine" else None}
    return out


def single_process(steps: int = 5) -> list[float]:
    """The reference: plain PyTorch, one process, the whole global batch, fp32 Adam."""
    model = build_model("gpt", 0, gpt=GPT)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)
        loss = gpt_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
