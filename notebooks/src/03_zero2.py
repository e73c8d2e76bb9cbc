# %% [markdown]
# # Chapter 3 · ZeRO-2 ($P_{os+g}$): partition the gradients too
#
# After ZeRO-1 a rank updates only its shard, yet it still holds the gradient of every
# parameter. ZeRO-2 keeps only the gradient shard it will use (paper Sec 5.2). The
# saving is real only if the full gradient never exists at once: gradients have to be
# reduced in buckets *during* backward and each bucket freed as soon as it is reduced.
# This chapter measures that on real ranks, and takes apart the blog's finding (chapter
# 2's reproduction, see the glossary) of a ZeRO-2 peak *above* ZeRO-1's.
#
# **Learning goals.** After this chapter you can
#
# 1. state ZeRO-2's model-state memory, $2\Psi + (2 + K)\Psi/N_d$ bytes (Sec 5.2, Fig 1),
#    and check it against bytes measured on running ranks;
# 2. write the hook that reduce-scatters a finished gradient bucket into a rank's shard and
#    frees the full gradient, then follow the same path in `Zero2Engine` and read the
#    result off a memory timeline;
# 3. explain, measured, why a ZeRO-2 that keeps full gradients and builds each
#    reduce-scatter input from $N_d$ gradient copies peaks above ZeRO-1;
# 4. choose a bucket size for what it does to the peak (Sec 5.2, Sec 6.2).

# %% [markdown]
# ## 1. The idea in numbers
#
# Under ZeRO-1 rank $r$ receives, through the reduce-scatter, the averaged gradient of
# its shard, and never reads the rest of the gradient buffer again. ZeRO-2 stops
# keeping the rest (Sec 5.2). Per rank, in mixed precision:
#
# $$\text{ZeRO-1: } 2\Psi + 2\Psi + \frac{K\Psi}{N_d} \qquad\longrightarrow\qquad
# \text{ZeRO-2: } 2\Psi + \frac{(2 + K)\Psi}{N_d}.$$
#
# Fig 1's $\Psi = 7.5\text{B}$ at $N_d = 64$ goes from 31.4 GB to 16.6 GB per GPU. The
# communication does not change: reduce-scatter of gradients plus all-gather of
# parameters, $2\Psi$ per step (Sec 7.2.1).
#
# The formula counts what a rank *keeps*. The peak also includes what exists for a
# moment: a gradient has to be computed in full before it can be reduced. The paper's
# answer is bucketization (Sec 5.2): reduce gradients in buckets as backward produces
# them, and release each bucket once reduced, so only a few buckets of full gradient
# are ever alive; Sec 6.2 keeps such buffers at a constant size.

# %%
import argparse
import time

import matplotlib.pyplot as plt

from zerolearn.chapters.ch02 import lesson as ch02
from zerolearn.chapters.ch03 import lesson as ch03
from zerolearn.chapters.source import excerpt
from zerolearn.config import TrainConfig
from zerolearn.dist import launch
from zerolearn.engines import backward, base, zero2
from zerolearn.experiments import seed_experiment
from zerolearn.flat import make_buckets
from zerolearn.models import GPTConfig, build_model
from zerolearn.tables import kib, text_table

# %% [markdown]
# The measured runs use chapter 2's wider GPT ($d_{model} = 128$, $\Psi = 464{,}384$)
# rather than the book's GPT of the exercises ($\Psi = 42{,}368$): its fp32 gradient, 1.77
# MiB, is large enough for buckets of 0.05 to 0.5 MiB to cut it into many pieces.

# %%
D_MODEL, SEQ_LEN, N_LAYER = 128, 16, 2  # the GPT of chapter 2
GPT = TrainConfig(model="gpt", d_model=D_MODEL, seq_len=SEQ_LEN, n_layer=N_LAYER, global_batch_size=12, steps=2,
                  memory_timeline=True, bucket_mb=0.25)
gpt = build_model("gpt", 0, gpt=GPTConfig(seq_len=SEQ_LEN, n_layer=N_LAYER, d_model=D_MODEL))
psi = sum(p.numel() for p in gpt.parameters())
named = [(n, p) for n, p in gpt.named_parameters()][::-1]  # the engine's order: reverse registration
print(f"GPT: Psi = {psi:,} parameters; full fp32 gradient = {kib(4 * psi, unit=True)}")

# %% [markdown]
# The same view for ZeRO-2, at Fig 1's setting. Move **Nd**: the gradients row falls as
# $2\Psi/N_d$ while the parameters stay at $2\Psi$, and the traffic stays at $2\Psi$ per
# step (Sec 7.2.1).

# %%
# %matplotlib inline
from IPython.display import display

from zerolearn import widgets
from zerolearn.figures import formulas

display(widgets.StageExplorer(stage=2))  # Fig 1's setting: Psi = 7.5B, Nd = 64, K = 12

# %%
formulas.stage_figure(stage=2)  # the default view, drawn for the book

# %% [markdown]
# ## 2. Buckets during backward
#
# First the schedule ZeRO-2 relies on (Sec 5.2), for one backward of chapter 2's GPT on 2
# ranks: its gradients cut into 12 buckets of at most 0.25 MiB, one colour per bucket, the
# last layers' bucket first. Top, the ideal from the package's cost model (chapter 6): each bucket is
# reduce-scattered the moment its last gradient is in, and its full gradients can then be
# freed. Bottom, the reduce-scatters this machine recorded (section 7 reads the times).
# Look at the order: one reduction per bucket, launched while backward still runs.

# %%
from zerolearn.figures import schematics

schematics.bucket_schedule_figure(stage=2)

# %% [markdown]
# ### 2.1 Two buckets by hand, on live ranks
#
# The same schedule with numbers you can follow. `%%ranks 2` (from `zerolearn.live`, as in
# chapter 2) runs a cell on 2 real gloo ranks that keep their variables between cells.
# Each rank's "backward" makes 7 gradient elements in two buckets: bucket 0 (the last
# layer's, made first) has 4 elements, bucket 1 has 3, padded to 4 so that 2 ranks get 2
# each. Rank $r$'s gradient is $(r + 1)$ times the same numbers.

# %% tags=["live"]
# %load_ext zerolearn.live

# %% tags=["live"]
# %%ranks 2
pending = [(rank + 1) * torch.tensor([1.0, 2.0, 3.0, 4.0]),  # bucket 0, complete first
           (rank + 1) * torch.tensor([5.0, 6.0, 7.0, 0.0])]  # bucket 1: 3 elements + 1 padding
shards = []  # what this rank keeps: one 2-element shard per bucket
print([b.tolist() for b in pending])

# %% [markdown]
# Backward has completed bucket 0: reduce-scatter it at once, keep this rank's half as
# the mean over ranks, and drop the full bucket. Rank 0 keeps $1.5\cdot[1, 2]$, rank 1
# $1.5\cdot[3, 4]$.

# %% tags=["live"]
# %%ranks
full = pending.pop(0)
shard = torch.empty(full.numel() // world_size)
dist.reduce_scatter_single(shard, full)  # (output, input)
shards.append(shard / world_size)  # the mean over ranks
del full  # the full bucket is gone: only the shard stays
print(f"kept {[s.tolist() for s in shards]}; full buckets still waiting: {len(pending)}")

# %% [markdown]
# Then bucket 1, the same four lines. Rank 1's shard ends in the padding element, 0.

# %% tags=["live"]
# %%ranks
full = pending.pop(0)
shard = torch.empty(full.numel() // world_size)
dist.reduce_scatter_single(shard, full)
shards.append(shard / world_size)
del full
print(f"kept {[s.tolist() for s in shards]}; full buckets still waiting: {len(pending)}")

# %% tags=["live"]
# %ranks stop

# %% [markdown]
# Each rank now keeps 4 of the 8 padded gradient elements, and each full bucket was
# dropped as soon as its reduce-scatter returned: the engine below keeps only a few
# buckets in flight, never the whole gradient. The exercise below does this from autograd's
# hooks, on a real model.

# %% [markdown]
# The shared engine base registers a hook on every parameter that fires once autograd
# has accumulated that parameter's gradient. The hook copies the gradient into its
# group's flat buffer, drops autograd's copy, and when the group is complete launches
# the group's reduction, while backward carries on with earlier layers. Before reading
# the engine's version, write its core yourself. The exercises of this book are
# functions with a stated signature; `exercises.check` runs yours on 2 and then 3 real
# gloo ranks (3 ranks make uneven shards, so buckets need padding) and compares it
# with single-process training and with the memory and communication ledgers. Besides
# their arguments, exercise functions may use the names the next cell imports.

# %%
import torch  # noqa: F401 - for the exercises' functions
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from torch import nn  # noqa: F401

from zerolearn import comm, exercises  # noqa: F401

# %% [markdown]
# ### Exercise 1 · the bucket hook
#
# Chapter 1's `bucket_hook` all-reduced whole buckets from autograd hooks; ZeRO-2
# reduce-scatters them and keeps only a shard. Write `reduce_scatter_hook(bucket, shard,
# world_size)`. `bucket` is a list of fp32 parameters whose gradients, laid end to end
# in that order and zero-padded, form a flat buffer of `world_size * shard.numel()`
# elements; `shard` (fp32, 1-D) is this rank's slice of it. Register a
# `register_post_accumulate_grad_hook` on every parameter (autograd calls `hook(p)` once
# `p.grad` is complete). When the last parameter of the bucket has its gradient, write
# the mean over ranks of this rank's slice into `shard` with one
# `dist.reduce_scatter_single(output, input)`, and free the full gradients. The checker trains
# a small MLP (4 Linear layers of width 64, 16,640 parameters: one process retrains it in
# no time) for 3 SGD steps in 3 buckets and compares every shard with one process; it measures, with the memory
# ledger, the gradient bytes alive after backward (only the shards may be), and counts
# the elements your hooks move (1 $\Psi$).

# %% tags=["exercise"]
# exercise: 03.reduce_scatter_hook

# %%
exercises.check("03.reduce_scatter_hook", reduce_scatter_hook)

# %% [markdown]
# The engine's hook does the same for every bucket of the model, with two differences:
# it copies each gradient into the bucket's flat buffer as it arrives (and drops
# autograd's copy), and it launches the reduction asynchronously, finishing it later.
# The lines that matter, from `Engine._on_grad` and `Engine._launch`:

# %%
excerpt(backward.GradientReduction, ("view = b.grad_view(i)", "self._on_bucket_ready(b)"),
        ("with comm.unit(b.layout.label", "self._finish_oldest()"))

# %%
print(f"MAX_IN_FLIGHT = {base.MAX_IN_FLIGHT}  # reductions launched but not finished")

# %% [markdown]
# A bucket is a flat buffer of at most `--bucket-mb` MiB (chapter 2). Buckets are
# launched in one fixed order on every rank, because collectives pair up by order.
# `MAX_IN_FLIGHT` bounds the reductions in progress: when one more is launched, the
# oldest is waited for (`_finish_oldest`) and handed to the stage's `_after_reduce`. The
# ZeRO-2 engine keeps what ZeRO-1 keeps but the gradient: it reduce-scatters into a shard
# that it keeps, and frees the full bucket the moment the reduction is done:

# %%
excerpt(zero2.Zero2Engine, ("def _reduce", "return comm.reduce_scatter"), ("def _after_reduce", "b.grad_full = None"))

# %% [markdown]
# ## 3. Measured: bytes per rank and the gradient timeline
#
# The next cell runs the GPT on 4 ranks under ZeRO-1 and ZeRO-2 for several bucket
# sizes (used in Section 5), plus a bf16 run, all with `--memory-timeline`: the last
# step runs under `MemoryLedger`, which follows every tensor storage by category
# (params, grads, optimizer states, activations, temporary) and records the total after
# each allocation and free. A second launch on 2 ranks gives the $N_d = 2$ rows.

# %% tags=["nbval-ignore-output"]
BUCKETS = (0.05, 0.1, 0.2, 0.5, 2.0)  # MiB; the whole fp32 gradient is 1.77 MiB
t0 = time.perf_counter()
jobs4 = [("train", GPT.replace(stage=s, bucket_mb=b)) for b in BUCKETS for s in (1, 2)]
jobs4 += [("train", GPT.replace(stage=2, bucket_mb=0.2, dtype="bf16"))]
nd4 = launch(ch02.jobs, 4, jobs4)[0]  # train() reports are the same on every rank
sweep = {(r["config"]["stage"], r["config"]["bucket_mb"]): r for r in nd4[:-1]}
print(f"4 ranks, {len(jobs4)} runs: {time.perf_counter() - t0:.0f} s")

# %% tags=["nbval-ignore-output"]
jobs2 = [("train", GPT.replace(stage=2, bucket_mb=0.2, dtype=d)) for d in ("fp32", "bf16")]
t0 = time.perf_counter()
nd2 = launch(ch02.jobs, 2, jobs2)  # nd2[rank][job]
print(f"2 ranks, {len(jobs2)} runs: {time.perf_counter() - t0:.0f} s")

# %% [markdown]
# First, what each rank keeps, against the formula (Sec 5.2). Gradients are measured as
# held after backward, before the step; the formula uses the unpadded $\Psi$, and the
# padding (under $N_d$ elements per group) is shown. Then come the most gradient bytes
# alive at any moment of backward (measured by the engine), ZeRO-1's full gradient for
# comparison, the largest bucket, and the peak's excess over the shards in units of
# that bucket. Rows are named by $N_d$ and dtype.

# %%
runs = [(2, nd2[0][0]), (2, nd2[0][1]), (4, sweep[(2, 0.2)]), (4, nd4[-1])]
keeps, peaks = ch03.keeps_tables(runs, named, psi, base.MAX_IN_FLIGHT)
print(keeps)
print()
print(peaks)

# %% [markdown]
# What a rank keeps matches the formula exactly (first table): $2\Psi/N_d$ bytes of
# gradients in bf16 ($4\Psi/N_d$ in fp32), and the other two columns as in chapter 2. The
# *peak* of gradient memory is higher than the shards, since buckets are alive while they
# fill and while they are reduced: the second table measures that excess in buckets, and
# it stays within the engine's bound, `MAX_IN_FLIGHT` + 2 (buckets in flight, one more
# being launched, one filling). Those few buckets are a constant (Sec 6.2), while
# the shards shrink with $N_d$ and the full gradient grows with the model. In this small GPT a 0.2 MiB
# bucket is a sizeable part of the model, so in bf16 at $N_d = 2$ the peak even
# slightly exceeds ZeRO-1's full gradient; for a model of billions of parameters the
# same buckets are negligible.

# %% [markdown]
# The timeline shows the mechanism: the `grads` category
# over the last training step, for ZeRO-1 and ZeRO-2 with 0.2 MiB buckets, rank 0 of 4,
# fp32. (The first events of the step register the tensors that already exist,
# parameters and optimizer states, which is why the totals start by climbing.)

# %%
timelines = {stage: sweep[(stage, 0.2)]["ranks"][0]["memory"]["timeline"] for stage in (1, 2)}
ch03.grads_timeline_figure(timelines, psi)

# %% [markdown]
# Under ZeRO-1 the gradient climbs during backward to the full $4\Psi$ bytes and
# stays there through the step. Under ZeRO-2 it rises and falls bucket by bucket: each
# bucket fills, is reduce-scattered, and leaves only its shard behind. The step then
# works on shards only.
#
# ## 4. Why a reproduction found ZeRO-2's peak above ZeRO-1's
#
# The blog, "Understanding ZeRO: Memory-Efficient Training from Theory to Practice" by
# Dipankar Baisya (December 2025; chapter 2, and the glossary), trained 6 Linear layers of
# width 10,000 (600M parameters, fp32 Adam, batch 16) on 2 GPUs and reported peak memory of
# 8,090 MB under its ZeRO-1 and 8,470 MB under its ZeRO-2, attributing the difference
# to reduce-scatter buffers. ZeRO-2 holds strictly less than ZeRO-1 (Sec 5.2), so the
# surplus has to come from the implementation. Its ZeRO-2 did three things, rebuilt
# faithfully below on chapter 2's `NaiveZero1`:
#
# 1. hooks meant to *discard* the gradients a rank does not own, by returning `None`;
# 2. after backward, for each tensor, a reduce-scatter whose input is the full gradient
#    concatenated $N_d$ times and whose output is full size;
# 3. only then, tensor by tensor, dropping the gradients it does not own.

# %%
class BlogZero2(ch02.NaiveZero1):  # chapter 2's naive ZeRO-1: whole tensors, then broadcasts
    def __init__(self, model, lr=1e-3, owners="count"):
        super().__init__(model, lr, owners)
        for p, owner in zip(self.params, self.owners, strict=True):  # 1. meant to discard others' gradients
            p.register_hook(lambda grad, keep=owner == self.rank: grad if keep else None)

    @torch.no_grad()
    def step(self):
        for p, owner in zip(self.params, self.owners, strict=True):
            stacked = torch.cat([p.grad.reshape(-1)] * self.world_size)  # 2. Nd copies of the full gradient
            out = p.grad.new_empty(p.numel())  # and a full-size output
            dist.reduce_scatter_single(out, stacked)  # every rank receives the whole sum
            p.grad = (out / self.world_size).view_as(p) if owner == self.rank else None  # 3. dropped only now
        self.optimizer.step()
        for p, owner in zip(self.params, self.owners, strict=True):
            dist.broadcast(p.data, src=owner)

# %% [markdown]
# Item 1 is where it goes wrong. `tensor.register_hook(fn)` calls `fn(grad)` when the
# gradient of `tensor` is computed, and `fn` may return a new gradient to use *instead*;
# returning `None` means "keep the original", it discards nothing. (The checker of
# Exercise 1 knows this bug as `keeps_whole_gradient`.) On a tiny tensor:

# %%
x = torch.ones(3, requires_grad=True)
x.register_hook(lambda grad: None)  # the blog's "discard"
(2 * x).sum().backward()
print(f"gradient still there after a hook returned None: {x.grad is not None}")

# %% [markdown]
# So every rank still holds the full gradient after backward, exactly as in ZeRO-1. On
# top of it, each reduce-scatter briefly needs $N_d$ copies of the tensor's gradient
# plus a full-size output, and since every rank receives the full sum the
# "reduce-scatter" is an all-reduce that moves $N_d$ times the data. To compare with the
# blog we leave the GPT here and run the blog's own model, 6 square Linear layers, at
# width 512 instead of 10,000 so that it fits two CPU ranks: the seed experiment (the
# book's rerun of the blog's runs, `zerolearn.experiments.seed_experiment`; see the
# glossary) builds it. On 2 ranks we measure all four versions: our ZeRO-1 and ZeRO-2,
# chapter 2's `NaiveZero1` and `BlogZero2`.
# One Linear layer of fp32 gradient is 1,026 KiB here.

# %% tags=["nbval-ignore-output"]
ns = argparse.Namespace(width=512, layers=6, batch=16, steps=2, dtype="fp32", bucket_mb=1.0,
                        simulate_world_size=None)
mlp = {s: seed_experiment.job_config(ns, s).replace(memory_timeline=True) for s in (1, 2)}  # the seed experiment's
blog = [("train", mlp[1]), ("train", mlp[2]), ("naive", ch02.NaiveZero1, mlp[1]), ("naive", BlogZero2, mlp[2])]
t0 = time.perf_counter()
ours1, ours2, blog1, blog2 = launch(ch02.jobs, 2, blog)[0]
print(f"2 ranks, {len(blog)} runs: {time.perf_counter() - t0:.0f} s")

# %%
layer = 512 * 513 * 4  # bytes of one Linear(512, 512) gradient in fp32
mlp_psi = ours1["num_params"]
versions = (("blog-style ZeRO-1 (AR+bcast)", blog1), ("blog-style ZeRO-2", blog2),
            ("ours ZeRO-1 (engine)", ours1["ranks"][0]), ("ours ZeRO-2 (engine)", ours2["ranks"][0]))
rows = []
for (name, entry), run in zip(versions, (blog1, blog2, ours1, ours2), strict=True):
    held = entry["grads_bytes"] if "grads_bytes" in entry else entry["model_state_bytes"]["grads"]
    ops = {op: entry["comm"][op]["elements"] / 2 / mlp_psi for op in entry["comm"]}  # per step
    volume = 2 * ops["all_reduce"] + ops["reduce_scatter"] + ops["all_gather"] + ops["broadcast"]
    rows.append([name, kib(held), f"{ops['reduce_scatter']:.2f}", f"{volume:.2f}", f"{run['losses'][-1]:.4f}"])
print(f"MLP: Psi = {mlp_psi:,} parameters, 2 gloo ranks, fp32 Adam, 2 steps")
print(text_table(["version", "grads after\nbackward KiB", "RS input\nPsi/step", "total\nPsi/step", "final loss"],
                 rows, align=["left", *["right"] * 4]))

# %% [markdown]
# Peaks come from the memory ledger over the last step. A tensor handed to a
# collective is released when gloo's background thread lets go of it, a moment that
# varies from run to run, so the blog-style ZeRO-2's peak can move by a layer or so
# between runs, and the others slightly: these figures change with the run, while the
# conclusions printed after them hold in every run.

# %% tags=["nbval-ignore-output"]
rows = []
for i, (name, entry) in enumerate(versions):
    at_peak, ref = entry["memory"]["peak_by_category"], versions[0 if i < 2 else 2][1]["peak_bytes"]
    rows.append([name, kib(entry["peak_bytes"]), kib(at_peak["grads"]), kib(at_peak["temporary"]),
                 f"{(entry['peak_bytes'] - ref) / layer:+.2f}"])
print(text_table(["version", "peak KiB", "grads\nat peak", "temporary\nat peak", "peak - its ZeRO-1\nlayers"],
                 rows, align=["left", *["right"] * 4]))

# %%
peak = {name: entry["peak_bytes"] for name, entry in versions}
(b1, b2, o1, o2) = peak.values()
print(f"blog-style ZeRO-2 peaks above blog-style ZeRO-1, by more than 1 layer: {b2 - b1 > layer}")
print(f"our ZeRO-2 peaks below our ZeRO-1, by more than 1.5 layers:           {o1 - o2 > 1.5 * layer}")
print(f"our ZeRO-2 peaks below both blog-style versions:                     {o2 < min(b1, b2)}")

# %% [markdown]
# The measurements reproduce the blog's finding and show where it comes from. Both
# blog-style versions hold the full gradient at their peak; the ZeRO-2 one adds several
# layers' worth of temporary memory on top (the $N_d$ concatenated copies, the full-size
# output and its averaged copy), so its peak lands above its own ZeRO-1, whose
# temporaries are Adam's scratch for one tensor. It also moves $N_d\Psi$ of
# reduce-scatter input plus $\Psi$ of broadcasts per step. Our ZeRO-2 never holds the full gradient, its reduce-scatter
# input is the bucket itself, and its peak is below our ZeRO-1's, as the paper says.
# All four versions compute the same losses. (Our ZeRO-1 and the blog-style ZeRO-1 peak
# within a fraction of a layer of each other: both hold the full gradient, and both
# publish without a copy, ours with an all-gather that runs in place in the parameter
# buffer, the blog-style version by updating in place and broadcasting.)

# %% [markdown]
# Over the step the difference looks like this (total tracked bytes on rank 0):

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, pair, title in ((axes[0], versions[:2], "blog-style versions"), (axes[1], versions[2:], "the engines")):
    for (name, entry), style in zip(pair, ("--", "-"), strict=True):
        timeline = entry["memory"]["timeline"]
        ax.plot([e[2] / 2**20 for e in timeline], style, label=f"{name}: peak {entry['peak_bytes'] / 2**20:.1f} MiB")
    ax.set_xlabel("allocation and free events in the last step (event index)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower center")
axes[0].set_ylabel("tracked memory on rank 0 (MiB)")
fig.suptitle("MLP 6 x Linear(512, 512), 2 ranks, fp32 Adam: memory over one step")
fig.tight_layout()
plt.show()

# %% [markdown]
# At the blog's own width, 10,000, the model no longer fits two CPU ranks. The book stores
# one run of the seed experiment on a GPU at that width (2 ranks simulated on one device,
# each stage in a fresh process; `gpu_table()` reads it), beside the blog's four peaks.
# Ours are `torch.cuda.max_memory_allocated` in MiB, the blog's as it printed them:

# %%
gpu = seed_experiment.gpu_table()
print(f"MLP 6 x Linear(10000, 10000), fp32 Adam, 2 ranks, rank 0; measured on {gpu[0]['device']}")
print(text_table(["stage", "peak MiB\n(book)", "peak MB\n(blog)", "params\nMiB", "grads\nMiB", "optimizer\nMiB"],
                 [[r["name"], f"{r['peak_MiB']:,.0f}", f"{r['blog_peak_MB']:,}", f"{r['params_MiB']:,.0f}",
                   f"{r['grads_MiB']:,.0f}", f"{r['optimizer_states_MiB']:,.0f}"] for r in gpu],
                 align=["left", *["right"] * 5]))
print(f"ZeRO-2's peak below ZeRO-1's: book {gpu[2]['peak_MiB'] < gpu[1]['peak_MiB']}, "
      f"blog {gpu[2]['blog_peak_MB'] < gpu[1]['blog_peak_MB']}")

# %% [markdown]
# At full width our ZeRO-2 peaks below our ZeRO-1, as Sec 5.2 says, where the blog's peaked
# above: it holds half the gradient between steps, and its buckets keep the full gradient
# from ever being alive at once.

# %% [markdown]
# ## 5. Bucket size and ZeRO-2's peak
#
# Bucketing is what turns the $2\Psi/N_d$ of the formula into a low peak, so the bucket
# size matters. Small buckets keep only a little full gradient alive; one bucket as
# large as the model keeps the whole gradient alive until backward ends, exactly like
# ZeRO-1. A parameter is never split across buckets, so the largest tensor sets the
# smallest possible bucket. Smaller buckets mean more collective calls, each paying a
# latency; that trade-off is why the paper fixes a constant, performance-tuned buffer
# size (CB, Sec 6.2). The sweep ran in Section 3 (GPT, 4 ranks, fp32):

# %%
rows = []
for b in BUCKETS:
    groups = make_buckets(named, int(b * 2**20), 4, 4, 0)
    two = sweep[(2, b)]["ranks"][0]
    rows.append([b, len(groups), kib(max(g.padded_numel for g in groups) * 4), kib(two["peak_grad_bytes"]),
                 two["comm"]["reduce_scatter"]["calls"] // 2])
print(text_table(["bucket MiB", "groups", "largest group\nKiB", "ZeRO-2 peak\ngrads KiB", "ZeRO-2 RS\ncalls/step"],
                 rows))
print(f"(ZeRO-1 keeps the full gradient, {kib(4 * psi, unit=True)}, at every bucket size; ZeRO-2's shards are "
      f"{kib(psi, unit=True)})")

# %% [markdown]
# The peak of *all* memory (ledger, last step) against bucket size, for both stages. As in
# Section 4 these totals can move slightly between runs; the claims after the table hold
# in every run:

# %% tags=["nbval-ignore-output"]
rows = []
for b in BUCKETS:
    one, two = (sweep[(s, b)]["ranks"][0]["peak_bytes"] for s in (1, 2))
    rows.append([b, kib(one), kib(two), f"{two / one:.3f}"])
print(text_table(["bucket MiB", "ZeRO-1 peak KiB", "ZeRO-2 peak KiB", "ZeRO-2 / ZeRO-1"], rows))

# %%
ratio = {b: sweep[(2, b)]["ranks"][0]["peak_bytes"] / sweep[(1, b)]["ranks"][0]["peak_bytes"] for b in BUCKETS}
print(f"ZeRO-2's peak below ZeRO-1's for buckets up to 0.2 MiB, by more than 5 %: "
      f"{all(ratio[b] < 0.95 for b in BUCKETS if b <= 0.2)}")
print(f"with one bucket for the whole model ({BUCKETS[-1]} MiB), within 2 % of ZeRO-1's: "
      f"{abs(ratio[BUCKETS[-1]] - 1) < 0.02}")

# %%
ch03.bucket_figure(BUCKETS, sweep, psi, nd=4)

# %% [markdown]
# With buckets much smaller than the model, ZeRO-2's gradient peak stays near the
# shards plus a few buckets, and its overall peak sits below ZeRO-1's. As buckets grow
# the gradient peak grows with them; with a single bucket for the whole model the full
# gradient exists at the end of backward and ZeRO-2 loses its advantage (its gradient
# peak is then the full gradient *plus* the shard being reduced into). Below
# about 0.25 MiB the gradient peak hardly falls: the largest tensors (65,536 elements,
# 256 KiB in fp32) form buckets of their own, whatever the cap.

# %% [markdown]
# ## 6. Gradient accumulation: traffic against memory
#
# With gradient accumulation a step runs several micro-batches before one update. ZeRO-2
# can accumulate in two ways. Calling `backward` once per micro-batch, as plain PyTorch
# code does, reduce-scatters every micro-batch at once and adds the result into the
# rank's shard: between micro-batches only $2\Psi/N_d$ bytes of gradient are held (in bf16;
# $4\Psi/N_d$ in the fp32 run below), but
# each micro-batch costs a full reduce-scatter. `engine.no_sync()` (as in torch DDP) lets
# gradients add up locally and reduces once, after the last micro-batch: a quarter of
# the calls here, but the whole gradient, $2\Psi$ bytes ($4\Psi$ in fp32), lives until then, which is
# ZeRO-1's gradient memory. Both give the same update. Four micro-batches on 2 ranks,
# the chapter's GPT in fp32 with 0.25 MiB buckets, measured:

# %%
acc = launch(ch03.accumulation_tradeoff, 2)[0]
rows = [[way, r["reduce_scatter_calls"], r["reduce_scatter_elements"], kib(r["peak_grad_bytes"]),
         " ".join(f"{x:.4f}" for x in r["losses"])] for way, r in acc.items()]
print(text_table(["way", "reduce-scatter\ncalls/step", "elements/step", "peak grads KiB", "losses"], rows,
                 align=["left", *["right"] * 4]))
print(f"full fp32 gradient: {kib(4 * acc['no_sync']['psi'], unit=True)}")

# %% [markdown]
# The one-reduction way moves a quarter of the data and holds the full gradient at its
# peak; the per-micro-batch way moves the gradient once per micro-batch and peaks lower,
# at the buckets waiting for their turn plus the shards (gradients arrive in another
# order than buckets launch, so several buckets wait at once). DeepSpeed's ZeRO-2 does
# the latter by default; when the interconnect, not memory, is the limit, `no_sync` is
# the better trade.

# %% [markdown]
# ### Exercise 2 · accumulate into the shard
#
# Write the core of the per-micro-batch way: `accumulate(shard, bucket_grad,
# micro_batch, micro_batches, world_size)`. It is called for each bucket after each
# micro-batch's backward, with `bucket_grad` the bucket's flat, zero-padded gradient
# (fp32, `world_size * shard.numel()` elements) of this rank's mean loss on that
# micro-batch. Reduce it at once with one `dist.reduce_scatter_single` and accumulate into
# `shard`, so that after micro-batch `micro_batches - 1` the shard holds this rank's
# slice of the step's gradient: the mean over ranks and micro-batches. At micro-batch
# 0 the shard still holds the previous step's gradient. The checker runs 3 SGD steps of
# 4 micro-batches on the MLP of Exercise 1 and compares every shard, at the end of each
# step, with one process on the whole global batch.

# %% tags=["exercise"]
# exercise: 03.accumulate

# %%
exercises.check("03.accumulate", accumulate)

# %% [markdown]
# ## 7. Bucket size and time, on two CPU cores
#
# Bucket size also trades calls against overlap: few large buckets mean few calls, but a
# reduction starts only once its whole bucket is ready; many small ones start early and each
# pays a call's start-up cost. Seeing that trade needs communication on links of its own, as
# on GPUs, so we plot no sweep ([appendix: what two CPU cores cannot show](../book/cpu_timelines.md)).
# What a recorded step does show is section 2's schedule, the ideal beside the measured, at
# 0.25 MiB:

# %%
for stage in (1, 2):
    sched = schematics.bucket_schedule(stage=stage)
    compute_end = sched.ideal[-1][1]
    hidden = sum(max(0.0, min(e, compute_end) - b) for *_, b, e in sched.ideal) / sum(
        e - b for *_, b, e in sched.ideal)
    print(f"stage {stage}: compute {sched.compute_s * 1e3:4.1f} ms, {len(sched.buckets)} reduce-scatters "
          f"{sched.comm_s * 1e3:4.1f} ms; backward ends at {sched.ideal[-1][3] * 1e3:4.1f} ms ideal "
          f"({hidden:.0%} hidden), {sched.backward_s * 1e3:4.1f} ms measured")

# %% [markdown]
# The reductions take longer than the compute they could hide behind. So even the ideal
# schedule, whatever the bucket size, hides at most backward's compute, and backward's
# length on this machine is set by the reductions' CPU time; the measured backward ends
# about 3 ms after the ideal one. What carries over to GPUs is the schedule: the order in which buckets fill and
# launch, one reduce-scatter per bucket per step, and each bucket's gradients freed as soon
# as it is reduced, which is what kept ZeRO-2's peak low in sections 3 and 5.

# %% [markdown]
# ## 8. Your engine trains
#
# Your `reduce_scatter_hook` is what turns chapter 2's ZeRO-1 into ZeRO-2. In
# `zerolearn/nano.py` (under 300 lines, read top to bottom) stage 2 keeps one gradient
# shard, registers your hooks over the whole model as one bucket, and steps with
# `zero1_step` on the shard your hooks reduced:

# %%
from zerolearn.chapters.your_engine import your_engine
from zerolearn.nano import NanoZero

excerpt(NanoZero, ("if stage == 2:", "self.fn[\"reduce_scatter_hook\"]"),
        ("elif self.stage == 2:", "args, kwargs ="))

# %% [markdown]
# The next cell trains the exercises' GPT (Ψ = 42,368) for four steps on 2 ranks with your
# hook, beside one process on the whole batch and beside the package's `Zero2Engine`. Your
# losses must equal one process's; the gradients a rank keeps are now $4\Psi/N_d$ bytes in
# fp32, so its bytes follow Fig 1's $(4 + (4 + K)/N_d)\Psi$ with 4-byte parameters and
# gradients ($K = 12$ for yours, which keeps an fp32 master); the traffic stays $2\Psi$
# per step (Sec 7.2.1).

# %%
your_engine(2, {"reduce_scatter_hook": reduce_scatter_hook})

# %% [markdown]
# What the package's engine adds to these few lines:
#
# | the package's engine adds | why | where |
# |---|---|---|
# | buckets of a fixed size, not one for the model | a low peak: few full buckets alive | §2, §5 above; Sec 5.2, 6.2 |
# | reductions in flight, at most `MAX_IN_FLIGHT` | overlap with backward, bounded buffers | §2, §7 above |
# | one launch order on every rank | collectives pair up by order | §2 above; ch. 7 |
# | in fp32, the master *is* the rank's slice | $K = 8$, not 12: no separate copy | ch. 2 §1 |
# | fp16 with a loss scale; gradient clipping | fp16 underflow; a norm over all shards | `engines/base.py` |
# | gradient accumulation into the shard | larger batches, gradients still $1/N_d$ | §6 above |
# | optimizer state and step on the CPU | the $K\Psi/N_d$ bytes leave the GPU | ch. 8 §1 |

# %% [markdown]
# ## Questions
#
# Write your answer down before running the cell after each question.
#
# 1. Predict the most bytes of ZeRO-2's gradients alive at once on 4 ranks in fp32 with
#    0.5 MiB buckets: at most the shards plus `MAX_IN_FLIGHT` + 2 of the largest bucket
#    (section 3). Then read the measurement.

# %%
two = sweep[(2, 0.5)]["ranks"][0]
largest = max(g.padded_numel for g in make_buckets(named, int(0.5 * 2**20), 4, 4, 0)) * 4
shards = two["model_state_bytes"]["grads"]
bound = shards + (base.MAX_IN_FLIGHT + 2) * largest
print(f"shards {kib(shards, unit=True)} + ({base.MAX_IN_FLIGHT} + 2) x largest bucket {kib(largest, unit=True)} "
      f"= at most {kib(bound, unit=True)}; measured peak {kib(two['peak_grad_bytes'], unit=True)}, "
      f"within the bound: {two['peak_grad_bytes'] <= bound}")

# %% [markdown]
# 2. How many reduce-scatters per step does ZeRO-2 launch with 0.05 MiB buckets? (A
#    tensor is never split across buckets.)

# %%
print(f"{len(make_buckets(named, int(0.05 * 2**20), 4, 4, 0))} buckets; measured "
      f"{sweep[(2, 0.05)]['ranks'][0]['comm']['reduce_scatter']['calls'] // 2} reduce-scatters per step")

# %% [markdown]
# 3. In bf16 on 4 ranks, how many KiB of gradients does a rank keep after backward?

# %%
print(kib(nd4[-1]["ranks"][0]["model_state_bytes"]["grads"], unit=True), f"(2 Psi / 4 = {kib(2 * psi / 4)} KiB)")

# %% [markdown]
# 4. Accumulating over 4 micro-batches with a `backward` each (section 6), how many Ψ
#    does a rank reduce-scatter per step?

# %%
way = acc["backward each micro-batch"]
print(f"{way['reduce_scatter_elements'] / way['psi']:.3f} Psi per step")

# %% [markdown]
# ## Summary
#
# - ZeRO-2 keeps $2\Psi + (2 + K)\Psi/N_d$ bytes of model states (Sec 5.2, Fig 1);
#   measured bytes on 2 and 4 gloo ranks match it up to padding, and traffic stays
#   $2\Psi$ per step (Sec 7.2.1).
# - The saving reaches the *peak* only if gradients are reduced in buckets during
#   backward and each full bucket is freed at once; the memory timeline shows ZeRO-2's
#   gradients rising and falling bucket by bucket while ZeRO-1's climb to $4\Psi$.
# - A ZeRO-2 that keeps full gradients (a hook returning `None` does not discard
#   anything) and builds each reduce-scatter input from $N_d$ copies of the gradient
#   holds what ZeRO-1 holds plus temporaries: a higher peak, and $(N_d + 1)\Psi$ moved
#   per step. That is what the blog measured.
# - Smaller buckets lower ZeRO-2's peak down to the largest tensor; a single bucket
#   gives the advantage away.
# - On two CPU cores the reductions outlast backward's compute: a recorded step shows
#   the buckets' schedule, not a GPU's overlap.
# - Accumulating by calling `backward` per micro-batch keeps the saving and pays one
#   reduction per micro-batch; `no_sync` pays one reduction per step and holds the full
#   gradient meanwhile. Next: partition the parameters themselves (ZeRO-3).
