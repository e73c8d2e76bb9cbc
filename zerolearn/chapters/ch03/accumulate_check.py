"""Exercise ``03.accumulate``'s check: gradient accumulation in ZeRO-2 (paper Sec 5.2).

The reader reduces one micro-batch's bucket gradient and adds it into this rank's
shard, so that after the step's last micro-batch the shard holds the step's mean
gradient. The trial trains the book's MLP with SGD for three steps of four
micro-batches on 2 and 3 ranks and checks every bucket's shard against single-process
training on the whole global batch, naming a lost micro-batch, a shard never reset
and a missing or doubled division, and one reduce-scatter per micro-batch.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch03.accumulate`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.chapters.ch03.accumulate import accumulate
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, register, unchanged
from zerolearn.exercises.helpers import WIDTH, close_to, compare_shard, mlp, mlp_buckets, mlp_grads, sgd_on_shards

BATCH, STEPS, MICRO = 12, 3, 4  # BATCH * MICRO samples per global batch


def _last_only(shard, bucket_grad, micro_batch, micro_batches, world_size):
    dist.reduce_scatter_single(shard, bucket_grad)  # writes the shard every time: earlier micro-batches are lost
    shard /= world_size


_rebinds_shard = edited(accumulate, {
    "        shard.copy_(part)  # a new step: the previous step's gradient goes\n":
    "        shard = part  # a new step: the previous step's gradient goes\n",
    "        shard.add_(part)": "        shard = shard + part"}, name="_rebinds_shard",
    doc="The shard's new value bound to the name ``shard``: the caller's shard is never written.")

_no_divide = edited(accumulate, {"part /= world_size * micro_batches": "part /= world_size"}, name="_no_divide")

_divide_twice = edited(accumulate, {
    "        shard.add_(part)\n": "        shard.add_(part)\n    if micro_batch == micro_batches - 1:\n"
    "        shard /= micro_batches  # 'average the accumulated gradient': already done above\n"}, name="_divide_twice")

_never_resets = edited(accumulate, {
    "    if micro_batch == 0:\n        shard.copy_(part)  # a new step: the previous step's gradient goes\n"
    "    else:\n        shard.add_(part)\n": "    shard.add_(part)\n"}, name="_never_resets")


def _accumulate_trial(fn) -> str:
    """Three SGD steps of MICRO micro-batches each, the reader reducing every bucket of every one."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, buckets, layouts = mlp_buckets(ws, rank)
    ref = mlp()
    shards = [torch.zeros(layout.shard_numel) for layout in layouts]
    psi, padded = sum(layout.numel for layout in layouts), sum(layout.padded_numel for layout in layouts)
    batch = BATCH * MICRO
    previous = None
    for step in range(STEPS):
        x, y = data.mlp_batch(step, batch, WIDTH)
        mine = [t.chunk(MICRO) for t in (data.rank_slice(x, rank, ws), data.rank_slice(y, rank, ws))]
        comm.LEDGER.reset()
        starts = [shard.clone() for shard in shards]
        for i, (xm, ym) in enumerate(zip(*mine, strict=True)):
            model.zero_grad()
            F.mse_loss(model(xm), ym).backward()
            for b, layout, shard in zip(buckets, layouts, shards, strict=True):
                fn(shard, layout.flatten([p.grad for _, p in b], torch.float32, torch.device("cpu")), i, MICRO, ws)
        # The step's micro-batch i, over all ranks: rank r's i-th chunk of its slice.
        per_micro = [[torch.cat([data.rank_slice(t, r, ws).chunk(MICRO)[i] for r in range(ws)]) for t in (x, y)]
                     for i in range(MICRO)]
        micro_grads = [mlp_grads(ref, xm, ym) for xm, ym in per_micro]
        want = mlp_grads(ref, x, y)
        wants = []
        for k, (b, layout, shard) in enumerate(zip(buckets, layouts, shards, strict=True)):
            def shard_of(grads, b=b, layout=layout):
                return layout.shard_of(layout.flatten([grads[n] for n, _ in b], torch.float32, torch.device("cpu")))

            wants.append(shard_of(want))
            what = f"after {MICRO} micro-batches your shard of bucket {k}"
            unchanged(what, shard, starts[k], "shard", step=step)
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
        agree(step)  # before the step's own all-gathers: a rank that failed never joins them
        sgd_on_shards(buckets, layouts, shards, ref)
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
     "rebinds_shard": Bug(_rebinds_shard, "shard = part: a new tensor bound to the name instead of written into "
                          "the shard", "binds the name to a new tensor"),
     "never_resets": Bug(_never_resets, "accumulating across steps: the shard is never reset at the first "
                         "micro-batch (zero_grad forgotten)", "still holds step 0's gradient")}))
