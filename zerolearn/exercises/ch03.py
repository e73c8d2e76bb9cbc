"""Chapter 03's exercises: ZeRO-2's gradient path (paper Sec 5.2).

* ``03.reduce_scatter_hook``: once backward has made every gradient of a bucket,
  reduce-scatter the bucket into this rank's shard (the average over ranks) and free
  the full gradients.
* ``03.accumulate``: reduce one micro-batch's bucket and add it into the shard, so
  that after the step's last micro-batch the shard holds the step's mean gradient.

Both trials train the book's MLP (4 square Linear layers of width 64, 16,640 fp32
parameters; at 3 ranks every bucket is padded) with SGD on 2 and 3 ranks, and compare
every step's gradient shards with single-process training on the same global batch.
The helpers at the end (naming a flat element, spotting a gradient off by a factor)
serve chapter 4's and 5's trials too.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.exercises.core import Bug, Exercise, Wrong, first_difference, register
from zerolearn.flat import FlatLayout
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.models import build_model

WIDTH, LAYERS, BATCH, STEPS, LR, MICRO = 64, 4, 12, 3, 0.1, 4
# Buckets in the order backward completes them; the middle one spans two layers.
BUCKETS = (("layers.3",), ("layers.1", "layers.2"), ("layers.0",))


# ----- 03.reduce_scatter_hook ------------------------------------------------------------

def reduce_scatter_hook(bucket, shard, world_size):
    """Make backward reduce-scatter ``bucket``'s gradients into ``shard`` and free them (Sec 5.2).

    Args:
        bucket: list of fp32 parameters. Laid end to end in this order their gradients
            form a flat buffer of n = sum(p.numel()) elements, padded with zeros to
            world_size * shard.numel() elements.
        shard: fp32, 1-D, ceil(n / world_size) elements: this rank's slice of that flat
            buffer (elements rank * shard.numel() onwards), averaged over the ranks.
        world_size: the number of data-parallel ranks, Nd.

    Register a hook on every parameter, ``p.register_post_accumulate_grad_hook(hook)``:
    autograd calls ``hook(p)`` once ``p.grad`` holds p's gradient. When the last
    parameter of the bucket has its gradient (in every backward), write the mean over
    ranks of this rank's slice into ``shard`` with one ``comm.reduce_scatter(output,
    input)`` and free the bucket's full gradients (``p.grad = None``): ZeRO-2 keeps
    only the shard. Returns None.
    """
    # BEGIN SOLUTION
    ready = []

    def hook(p):
        ready.append(p)
        if len(ready) < len(bucket):
            return
        ready.clear()
        flat = torch.zeros(shard.numel() * world_size)
        torch.cat([q.grad.flatten() for q in bucket], out=flat[:sum(q.numel() for q in bucket)])
        for q in bucket:
            q.grad = None  # the full gradient goes; only the shard stays
        comm.reduce_scatter(shard, flat)
        shard.div_(world_size)

    for p in bucket:
        p.register_post_accumulate_grad_hook(hook)
    # END SOLUTION


def _hook_setup(bucket, shard, world_size, grad_of, free, reduce):
    # The bugs below differ from the solution only in these three places.
    ready = []

    def hook(p):
        ready.append(p)
        if len(ready) < len(bucket):
            return
        ready.clear()
        flat = torch.zeros(shard.numel() * world_size)
        torch.cat([grad_of(q).flatten() for q in bucket], out=flat[:sum(q.numel() for q in bucket)])
        if free:
            for q in bucket:
                q.grad = None
        reduce(shard, flat, world_size)

    for p in bucket:
        p.register_post_accumulate_grad_hook(hook)
        if not free:
            p.register_hook(lambda grad: None)  # meant to discard the gradient: returning None keeps it


def _mean_rs(shard, flat, world_size):
    comm.reduce_scatter(shard, flat)
    shard.div_(world_size)


def _keeps_whole_gradient(bucket, shard, world_size):
    _hook_setup(bucket, shard, world_size, lambda q: q.grad, False, _mean_rs)


def _sums(bucket, shard, world_size):
    _hook_setup(bucket, shard, world_size, lambda q: q.grad, True, lambda s, f, n: comm.reduce_scatter(s, f))


def _reduces_parameters(bucket, shard, world_size):
    _hook_setup(bucket, shard, world_size, lambda q: q, True, _mean_rs)


def _all_reduce_then_slice(bucket, shard, world_size):
    def reduce(shard, flat, n):
        comm.all_reduce(flat)
        rank = dist.get_rank()
        shard.copy_(flat[rank * shard.numel():(rank + 1) * shard.numel()] / n)

    _hook_setup(bucket, shard, world_size, lambda q: q.grad, True, reduce)


def _model_and_buckets(world_size: int, rank: int):
    """The MLP, its buckets [[(name, param)]] and their layouts for this rank."""
    model = build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)
    named = dict(model.named_parameters())
    buckets = [[(n, p) for n, p in named.items() if n.rsplit(".", 1)[0] in b] for b in BUCKETS]
    layouts = [FlatLayout.of([n for n, _ in b], [p.shape for _, p in b], world_size, rank) for b in buckets]
    return model, buckets, layouts


def _reference_grads(ref: nn.Module, x, y) -> dict[str, torch.Tensor]:
    ref.zero_grad()
    F.mse_loss(ref(x), y).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _sgd(buckets, layouts, shards, ref: nn.Module) -> None:
    """Each rank updates its shard of the parameters and all-gathers them; ``ref`` steps in one process."""
    with torch.no_grad():
        for b, layout, shard in zip(buckets, layouts, shards):
            full = layout.flatten([p for _, p in b], torch.float32, torch.device("cpu"))
            updated = layout.shard_of(full) - LR * shard
            comm.all_gather(full, updated)
            for (_, p), view in zip(b, layout.views(full)):
                p.copy_(view)
        for p in ref.parameters():
            p -= LR * p.grad


def _rs_trial(fn) -> str:
    """Three SGD steps of the MLP with the reader's hooks on every bucket, against one process."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, buckets, layouts = _model_and_buckets(ws, rank)
    ref = build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)
    shards = [torch.zeros(layout.shard_numel) for layout in layouts]
    for b, shard in zip(buckets, shards):
        fn([p for _, p in b], shard, ws)
    psi = sum(layout.numel for layout in layouts)
    padded = sum(layout.padded_numel for layout in layouts)
    shard_bytes = 4 * sum(s.numel() for s in shards)
    for step in range(STEPS):
        x, y = data.mlp_batch(step, BATCH, WIDTH)
        comm.LEDGER.reset()
        with MemoryLedger(record_timeline=False) as ledger:
            with ledger.phase("forward"):
                loss = F.mse_loss(model(data.rank_slice(x, rank, ws)), data.rank_slice(y, rank, ws))
            with ledger.phase("backward"):
                loss.backward()
        held = ledger.live["temporary"]  # made in backward, still alive: full gradients kept
        moved, reduced = comm.LEDGER.volume_elements(), comm.LEDGER.as_dict()
        want = _reference_grads(ref, x, y)
        for k, (b, layout, shard) in enumerate(zip(buckets, layouts, shards)):
            flat = layout.flatten([want[n] for n, _ in b], torch.float32, torch.device("cpu"))
            weights = layout.flatten([p for _, p in b], torch.float32, torch.device("cpu"))
            if torch.allclose(shard, layout.shard_of(weights), atol=1e-6) and shard.abs().sum() > 0:
                raise Wrong(f"your shard of bucket {k} holds the parameters' values, not their gradients: "
                            "register_post_accumulate_grad_hook calls hook(p) with the parameter p; its "
                            "gradient is p.grad", step)
            compare_shard(f"your shard of bucket {k}", shard, layout.shard_of(flat), layout, step,
                          factors={ws: f"reduce_scatter sums over the {ws} ranks; the mean divides by world_size"})
        if held > 4 * min(layout.numel for layout in layouts) / 2:
            whole = "keeps the whole gradient" if held >= 4 * psi else f"keeps {kib(held)} of full gradients"
            raise Wrong(f"this rank {whole}: {kib(held + shard_bytes)} after backward, ZeRO-2 keeps "
                        f"{kib(shard_bytes)} (its shards); free each full gradient (p.grad = None) once its "
                        "bucket is reduced", step)
        if moved != padded:
            how = (" (an all-reduce counts twice: it is a reduce-scatter plus an all-gather)"
                   if reduced["all_reduce"]["calls"] else "")
            raise Wrong(f"your hooks moved {moved / psi:.2f} Psi in backward{how}; ZeRO-2's reduce-scatter of "
                        f"the gradient moves {padded / psi:.2f} Psi, half of its 2 Psi per step (Sec 7.2.1)", step)
        _sgd(buckets, layouts, shards, ref)
    return (f"{STEPS} SGD steps of a {psi:,}-parameter MLP in {len(BUCKETS)} buckets: every gradient shard equals "
            f"single-process training, only the shards ({kib(shard_bytes)} per rank) outlive backward, and "
            f"backward moved {padded / psi:.2f} Psi")


register(Exercise(
    "03.reduce_scatter_hook", "ZeRO-2's bucket hook: reduce-scatter a finished bucket, free the full gradient",
    reduce_scatter_hook, _rs_trial,
    {"keeps_whole_gradient": Bug(_keeps_whole_gradient, "seed 002's blog ZeRO-2: its hooks return None to "
                                 "discard gradients, and a hook returning None keeps the gradient",
                                 "keeps the whole gradient"),
     "sums": Bug(_sums, "a reduce-scatter sums (its default op); the mean needs the division by Nd",
                 "times the single-process training gradient"),
     "reduces_parameters": Bug(_reduces_parameters, "picotron's bucketed DDP (STYLE.md): a post-accumulate-grad "
                               "hook receives the parameter, not the gradient", "the parameters' values"),
     "all_reduce_then_slice": Bug(_all_reduce_then_slice, "ZeRO-2 written as DDP plus slicing; the blog's "
                                  "reduce-scatter of Nd copies moves even more (seed 002)", "Psi in backward")}))


# ----- 03.accumulate ---------------------------------------------------------------------

def accumulate(shard, bucket_grad, micro_batch, micro_batches, world_size):
    """Reduce one micro-batch's bucket gradient and accumulate it into this rank's shard.

    Args:
        shard: fp32, 1-D, n elements: this rank's gradient shard of the bucket. At
            micro_batch 0 it still holds the previous step's gradient.
        bucket_grad: fp32, 1-D, world_size * n elements: the bucket's flat, zero-padded
            gradient of this rank's loss on this micro-batch (a mean over its samples).
        micro_batch: which micro-batch of the step this is, 0 ... micro_batches - 1.
        micro_batches: micro-batches per step.
        world_size: the number of data-parallel ranks, Nd.

    After the step's last micro-batch, ``shard`` must hold this rank's slice of the
    step's gradient: the mean of ``bucket_grad`` over the world_size ranks and the
    micro_batches micro-batches. Reduce every micro-batch at once with one
    ``comm.reduce_scatter(output, input)`` (ZeRO-2 keeps only the shard between
    micro-batches). Returns None.
    """
    # BEGIN SOLUTION
    part = torch.empty_like(shard)
    comm.reduce_scatter(part, bucket_grad)
    part /= world_size * micro_batches
    if micro_batch == 0:
        shard.copy_(part)  # a new step: the previous step's gradient goes
    else:
        shard.add_(part)
    # END SOLUTION


def _last_only(shard, bucket_grad, micro_batch, micro_batches, world_size):
    comm.reduce_scatter(shard, bucket_grad)  # writes the shard every time: earlier micro-batches are lost
    shard /= world_size


def _no_divide(shard, bucket_grad, micro_batch, micro_batches, world_size):
    part = torch.empty_like(shard)
    comm.reduce_scatter(part, bucket_grad)
    part /= world_size
    shard.copy_(part) if micro_batch == 0 else shard.add_(part)


def _divide_twice(shard, bucket_grad, micro_batch, micro_batches, world_size):
    part = torch.empty_like(shard)
    comm.reduce_scatter(part, bucket_grad)
    part /= world_size * micro_batches
    shard.copy_(part) if micro_batch == 0 else shard.add_(part)
    if micro_batch == micro_batches - 1:
        shard /= micro_batches  # "average the accumulated gradient": already done above


def _never_resets(shard, bucket_grad, micro_batch, micro_batches, world_size):
    part = torch.empty_like(shard)
    comm.reduce_scatter(part, bucket_grad)
    shard.add_(part / (world_size * micro_batches))


def _accumulate_trial(fn) -> str:
    """Three SGD steps of MICRO micro-batches each, the reader reducing every bucket of every one."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, buckets, layouts = _model_and_buckets(ws, rank)
    ref = build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)
    shards = [torch.zeros(layout.shard_numel) for layout in layouts]
    psi, padded = sum(layout.numel for layout in layouts), sum(layout.padded_numel for layout in layouts)
    batch = BATCH * MICRO
    previous = None
    for step in range(STEPS):
        x, y = data.mlp_batch(step, batch, WIDTH)
        mine = [t.chunk(MICRO) for t in (data.rank_slice(x, rank, ws), data.rank_slice(y, rank, ws))]
        comm.LEDGER.reset()
        for i, (xm, ym) in enumerate(zip(*mine)):
            model.zero_grad()
            F.mse_loss(model(xm), ym).backward()
            for b, layout, shard in zip(buckets, layouts, shards):
                fn(shard, layout.flatten([p.grad for _, p in b], torch.float32, torch.device("cpu")), i, MICRO, ws)
        # The step's micro-batch i, over all ranks: rank r's i-th chunk of its slice.
        per_micro = [[torch.cat([data.rank_slice(t, r, ws).chunk(MICRO)[i] for r in range(ws)]) for t in (x, y)]
                     for i in range(MICRO)]
        micro_grads = [_reference_grads(ref, xm, ym) for xm, ym in per_micro]
        want = _reference_grads(ref, x, y)
        wants = []
        for k, (b, layout, shard) in enumerate(zip(buckets, layouts, shards)):
            def shard_of(grads, b=b, layout=layout):
                return layout.shard_of(layout.flatten([grads[n] for n, _ in b], torch.float32, torch.device("cpu")))

            wants.append(shard_of(want))
            what = f"after {MICRO} micro-batches your shard of bucket {k}"
            last = shard_of(micro_grads[-1])
            if any(close_to(shard, c * last) for c in (1, 1 / MICRO, 1 / ws, 1 / (ws * MICRO))):
                lost = ", ".join(str(i) for i in range(MICRO - 1))
                raise Wrong(f"{what} holds only micro-batch {MICRO - 1}'s gradient: micro-batches {lost} were lost "
                            "(overwritten; after micro-batch 0, add into the shard)", step)
            if previous is not None and close_to(shard, wants[k] + previous[k]):
                raise Wrong(f"{what} still holds step {step - 1}'s gradient as well: at micro_batch 0 replace the "
                            "shard's content instead of adding to it", step)
            compare_shard(what, shard, wants[k], layout, step, factors={
                MICRO: f"divide by the {MICRO} micro-batches too",
                1 / MICRO: f"it is divided by the {MICRO} micro-batches twice",
                ws: f"reduce_scatter sums over the {ws} ranks; divide by world_size too"})
        previous = wants
        if comm.LEDGER.volume_elements() != MICRO * padded:
            raise Wrong(f"your function moved {comm.LEDGER.volume_elements() / psi:.2f} Psi over the step's "
                        f"{MICRO} micro-batches; one reduce-scatter per micro-batch moves {MICRO * padded / psi:.2f}",
                        step)
        _sgd(buckets, layouts, shards, ref)
    return (f"{STEPS} SGD steps of {MICRO} micro-batches each: every gradient shard equals single-process "
            f"training on the whole global batch of {batch}")


register(Exercise(
    "03.accumulate", "Gradient accumulation in ZeRO-2: reduce every micro-batch and add it into the shard",
    accumulate, _accumulate_trial,
    {"last_only": Bug(_last_only, "reduce-scatter straight into the shard at every micro-batch: the output "
                      "argument is overwritten, not added to", "were lost"),
     "no_divide": Bug(_no_divide, "a loss that is not divided by the accumulation steps (DeepSpeed divides it "
                      "in engine.backward; a hand-written loop must do it somewhere)", "4 times the single-process"),
     "divide_twice": Bug(_divide_twice, "dividing the loss by the accumulation steps and the accumulated "
                         "gradient again (DeepSpeed's engine.backward already scales the loss)", "twice"),
     "never_resets": Bug(_never_resets, "accumulating across steps: the shard is never reset at the first "
                         "micro-batch (zero_grad forgotten)", "still holds step 0's gradient")}))


# ----- helpers for the trials of chapters 3 to 5 -------------------------------------------

def kib(nbytes: float) -> str:
    """Bytes as KiB for a message: ``"65.0 KiB"``."""
    return f"{nbytes / 2**10:,.1f} KiB"


def located(layout: FlatLayout, index: int) -> str:
    """The parameter and position of element ``index`` of a flat buffer: ``"layers.1.weight[3, 5]"``."""
    for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets):
        if index < offset + math.prod(shape):
            position = torch.unravel_index(torch.tensor(index - offset), shape)
            return f"{name}[{', '.join(str(int(i)) for i in position)}]"
    return "the padding"


def close_to(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def compare_shard(what: str, got, want: torch.Tensor, layout: FlatLayout | None, step: int,
                  factors: dict[float, str] | None = None, reference: str = "single-process training") -> None:
    """Raise :class:`Wrong` at the first element of a shard that differs from ``want``.

    A shard that is ``want`` times one of ``factors`` gets that factor's explanation
    instead; otherwise the message names the first differing element's parameter and
    position (from ``layout``, which lays out the flat buffer the shard is cut from).
    """
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not close_to(got, want):
        for factor, why in (factors or {}).items():
            if close_to(got, factor * want):
                times = f"1/{round(1 / factor)} of" if factor < 1 else f"{factor:g} times"
                raise Wrong(f"{what} is {times} the {reference} gradient: {why}", step)
        if layout is not None:
            bad = ~torch.isclose(got.double(), want.double(), rtol=1e-5, atol=1e-6)
            where = located(layout, layout.shard_range[0] + int(bad.nonzero()[0]))
            what = f"{what} (first difference at {where})"
    first_difference(what, got, want, step=step, reference=reference)
