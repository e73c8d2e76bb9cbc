"""Exercise ``03.reduce_scatter_hook``'s check: ZeRO-2's bucket hook (paper Sec 5.2).

Once backward has made every gradient of a bucket, the reader's hook reduce-scatters
the bucket into this rank's shard (the average over ranks) and frees the full
gradients. The trial trains the book's MLP (16,640 fp32 parameters in 3 buckets; at 3
ranks every bucket is padded) with SGD for three steps on 2 and 3 ranks and checks
every gradient shard against single-process training, that only the shards outlive
backward (memory ledger), and that backward moved one reduce-scatter of the gradient.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch03.reduce_scatter_hook`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.chapters.ch03.reduce_scatter_hook import reduce_scatter_hook
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, register
from zerolearn.exercises.helpers import (
    BUCKETS,
    WIDTH,
    compare_shard,
    mlp,
    mlp_buckets,
    mlp_grads,
    settled,
    sgd_on_shards,
)
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.tables import kib

BATCH, STEPS = 12, 3


_keeps_whole_gradient = edited(reduce_scatter_hook, {
    "        for q in bucket:\n            q.grad = None  # the full gradient goes; only the shard stays\n": "",
    "        p.register_post_accumulate_grad_hook(hook)\n": "        p.register_post_accumulate_grad_hook(hook)\n"
    "        p.register_hook(lambda grad: None)  # meant to discard the gradient: returning None keeps it\n"},
    name="_keeps_whole_gradient")

_sums = edited(reduce_scatter_hook, {"        shard.div_(world_size)\n": ""}, name="_sums")

_reduces_parameters = edited(reduce_scatter_hook, {"q.grad.flatten()": "q.detach().flatten()"},
                             name="_reduces_parameters")

_all_reduce_then_slice = edited(reduce_scatter_hook, {
    "        dist.reduce_scatter_single(shard, flat)\n        shard.div_(world_size)\n":
    "        dist.all_reduce(flat)\n        rank = dist.get_rank()\n"
    "        shard.copy_(flat[rank * shard.numel():(rank + 1) * shard.numel()] / world_size)\n"},
    name="_all_reduce_then_slice")


def _rs_trial(fn) -> str:
    """Three SGD steps of the MLP with the reader's hooks on every bucket, against one process."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, buckets, layouts = mlp_buckets(ws, rank)
    ref = mlp()
    shards = [torch.zeros(layout.shard_numel) for layout in layouts]
    with MemoryLedger(record_timeline=False) as setup:  # what the reader's set-up allocates and keeps
        for b, shard in zip(buckets, shards, strict=True):
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
        kept = sum(setup.live.values())  # made at set-up, still alive: buffers the hooks keep
        limit = 4 * min(layout.numel for layout in layouts) / 2
        # made in backward, still alive: full gradients kept (once gloo has let go of its buffers)
        made = settled(lambda led=ledger: led.live["temporary"], lambda m, k=kept, cap=limit: m + k <= cap)
        held = made + kept
        moved, reduced = comm.LEDGER.volume_elements(), comm.LEDGER.as_dict()
        want = mlp_grads(ref, x, y)
        for k, (b, layout, shard) in enumerate(zip(buckets, layouts, shards, strict=True)):
            flat = layout.flatten([want[n] for n, _ in b], torch.float32, torch.device("cpu"))
            weights = layout.flatten([p for _, p in b], torch.float32, torch.device("cpu"))
            if torch.allclose(shard, layout.shard_of(weights), atol=1e-6) and shard.abs().sum() > 0:
                raise Wrong(f"your shard of bucket {k} holds the parameters' values, not their gradients: "
                            "register_post_accumulate_grad_hook calls hook(p) with the parameter p; its "
                            "gradient is p.grad", step)
            compare_shard(f"your shard of bucket {k}", shard, layout.shard_of(flat), layout, step,
                          factors={ws: f"reduce_scatter sums over the {ws} ranks; the mean divides by world_size"})
        if held > limit:
            whole = "keeps the whole gradient" if held >= 4 * psi else f"keeps {kib(held, unit=True)} of full gradients"
            if kept > made:
                raise Wrong(f"this rank keeps {kib(kept, unit=True)} allocated when your hooks were registered, "
                            f"alive after backward: {kib(held + shard_bytes, unit=True)} in all, ZeRO-2 keeps "
                            f"{kib(shard_bytes, unit=True)} (its shards); allocate each bucket's flat gradient in "
                            "the hook and let it go after the reduce-scatter, not once for the whole run", step)
            raise Wrong(f"this rank {whole}: {kib(held + shard_bytes, unit=True)} after backward, ZeRO-2 keeps "
                        f"{kib(shard_bytes, unit=True)} (its shards); free each full gradient (p.grad = None) once its "
                        "bucket is reduced", step)
        if moved != padded:
            how = (" (an all-reduce counts twice: it is a reduce-scatter plus an all-gather)"
                   if reduced["all_reduce"]["calls"] else "")
            raise Wrong(f"your hooks moved {moved / psi:.2f} Psi in backward{how}; ZeRO-2's reduce-scatter of "
                        f"the gradient moves {padded / psi:.2f} Psi, half of its 2 Psi per step (Sec 7.2.1)", step)
        agree(step)  # before the step's own all-gathers: a rank that failed never joins them
        sgd_on_shards(buckets, layouts, shards, ref)
    return (f"{STEPS} SGD steps of a {psi:,}-parameter MLP in {len(BUCKETS)} buckets: every gradient shard equals "
            f"single-process training, only the shards ({kib(shard_bytes, unit=True)} per rank) outlive backward, and "
            f"backward moved {padded / psi:.2f} Psi")


_flat_kept_from_setup = edited(
    reduce_scatter_hook, {"        flat = torch.zeros(shard.numel() * world_size)\n": "",
                          "    ready = []\n": "    flat = torch.zeros(shard.numel() * world_size)\n    ready = []\n"},
    name="_flat_kept_from_setup",
    doc="""One flat buffer per bucket allocated once at set-up and reused every step: as large as the
    bucket's whole gradient, alive for the whole run (the blog's ZeRO-2 keeps such buffers).""")


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
                                  "reduce-scatter of Nd copies moves even more (seed 002)", "Psi in backward"),
     "flat_kept_from_setup": Bug(_flat_kept_from_setup, "a bucket-sized flat buffer allocated once, when the hooks "
                                 "are registered, and kept: no allocation in backward, the whole gradient's size "
                                 "alive all the time", "allocated when your hooks were registered")}))
