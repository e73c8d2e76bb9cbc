# %% [markdown]
# # Chapter 1 · Data parallelism from scratch
#
# Data parallelism (DP) is the baseline ZeRO improves on (Sec 2.1). Each of N<sub>d</sub> processes,
# the *ranks*, holds a full replica of the model and trains on 1/N<sub>d</sub> of every global batch.
# After backward the ranks average their gradients, so all of them take the same optimizer step
# and the replicas stay identical. The computation per rank shrinks with N<sub>d</sub>, and
# communication is cheap: one all-reduce of the gradients per step. Memory does not shrink at
# all: every rank holds all the model states of chapter 0, so DP runs out of memory exactly where
# one GPU does (Sec 1: about 1.4B parameters on 32 GB GPUs).
#
# In this chapter we build DP on real `torch.distributed` process groups: gloo ranks spawned on
# this CPU, the same code that runs on GPUs with NCCL.

# %% [markdown]
# **Learning goals.** After this chapter you can
#
# 1. use the three collectives ZeRO is made of, all-reduce, reduce-scatter and all-gather, and
#    show on real ranks that an all-reduce *is* a reduce-scatter followed by an all-gather, moving
#    2 Ψ elements per rank (Sec 7.1);
# 2. write naive DP (one blocking all-reduce per parameter after backward) and explain why real
#    implementations instead reduce constant-size gradient *buckets* launched from autograd hooks
#    during backward (the scheme Sec 5.2 relies on);
# 3. check that DP is single-process training on the global batch: the same losses as one process
#    and as PyTorch's `DistributedDataParallel`;
# 4. measure the redundancy: every rank holds all 16 Ψ bytes of model states, whatever
#    N<sub>d</sub> is, and moves 2 Ψ elements per step.
#
# Names as in chapter 0: `psi` (Ψ) parameters, `nd` (N<sub>d</sub>) data-parallel ranks, `rank`
# (0 to `world_size` − 1), `k` (K) optimizer bytes per parameter. The model is the book's GPT of
# chapter 0 and of the exercises (Ψ = 42,368 in 29 tensors).

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from IPython.display import HTML

from zerolearn import comm
from zerolearn.chapters.ch01 import lesson as ch01
from zerolearn import exercises
from zerolearn.chapters.source import excerpt
from zerolearn.dist import launch
from zerolearn.engines.base import Engine
from zerolearn.figures import schematics
from zerolearn.memory import model as analytic
from zerolearn.models import build_model
from zerolearn.tables import text_table

# %% [markdown]
# ## 1. A distributed program
#
# A DP job is N<sub>d</sub> copies of one Python script, started together. `torchrun` starts them
# and gives each its place in environment variables: `RANK` (0 to N<sub>d</sub> − 1), `WORLD_SIZE`
# (N<sub>d</sub>), and where rank 0 listens (`MASTER_ADDR`, `MASTER_PORT`).
# `dist.init_process_group("gloo", rank=rank, world_size=world_size)` connects the processes
# through that address into a *process group*; gloo is torch's CPU backend, NCCL the GPU one.
# The ranks then call the same collectives in the same order, and
# `dist.destroy_process_group()` leaves the group before the process ends.
#
# ### Exercise 1: a whole program
#
# Write `main()` of `allreduce.py`, six lines: read this rank's `RANK` and `WORLD_SIZE` from
# `os.environ` (environment variables are strings), join the gloo process group, put rank + 1
# in a one-element tensor, sum it over the ranks with `dist.all_reduce(t)` (in place: afterwards
# every rank's `t` holds the sum), print `rank R of N: the sum is S`, and leave the group. The
# cell writes your script to `allreduce.py`:

# %% tags=["exercise", "nbval-ignore-output"]
# exercise: 01.allreduce

# %% [markdown]
# Now run it on two ranks: type the line in the next cell. `torchrun` is
# `python -m torch.distributed.run`. In a notebook `!` runs a shell line, and
# `{sys.executable}` puts this kernel's own Python in it, so that torchrun finds the same torch.
# `--standalone` picks a free port on this machine, `--nproc-per-node 2` starts two ranks, the
# script's name comes last, and `OMP_NUM_THREADS=1` in front gives each rank one thread (and
# silences torchrun's note that it would choose that).

# %% tags=["reader-types", "nbval-ignore-output"]
import sys

# !OMP_NUM_THREADS=1 {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 allreduce.py

# %% [markdown]
# Both ranks print 1 + 2 = 3, in either order. The checker runs your file the same way, under
# torchrun on 2 and then 3 ranks, and reads what each rank raised, which collectives it called,
# what it printed and whether it left the group:

# %%
exercises.check("01.allreduce", "allreduce.py")

# %% [markdown]
# On GPUs the script is the same with `"nccl"` and a
# `torch.cuda.set_device(rank)`; on several machines, `--nnodes` says how many there are and
# `--rdzv-endpoint` (or `--master-addr` and `--master-port`) where rank 0's machine is.
#
# ## 2. Collectives on four ranks
#
# A *collective* is one call that every rank makes together. Five come up in this book,
# drawn on four ranks holding four numbers each: the left column is what each rank
# holds before the call, the right what it holds after. A number's colour is the rank it
# came from; grey is a sum over ranks. ZeRO's engines use the last three: compare them.

# %%
schematics.collectives_figure(nd=4)

# %% [markdown]
# *Broadcast* copies the root's data to every rank, *reduce* sums onto the root,
# *all-reduce* sums onto every rank, *reduce-scatter* leaves rank r chunk r of the sum, and
# *all-gather* hands every rank all the chunks. Now the same calls on real ranks.
#
# `%%ranks 4` (from `zerolearn.live`) is the script above kept alive: 4 gloo ranks that have
# run `init_process_group` and keep their variables from one cell to the next, so a cell is a
# few lines of the script, run on every rank. Each rank starts with `rank`, `world_size`,
# `torch` and `dist`; every line a rank prints is labelled with its rank. Inside
# `with watching():` (from `zerolearn.watch`) the ledger counts the calls and elements of every
# collective. Each rank makes its own 8-element "gradient"; edit the cells and run them again.
# (`reduce_scatter_single` and `all_gather_single` are torch 2.13's names; torch 2.11 calls them
# `reduce_scatter_tensor` and `all_gather_into_tensor`, and zerolearn's ranks give it the new names too.)

# %% tags=["live"]
# %load_ext zerolearn.live

# %% tags=["live"]
# %%ranks 4
from zerolearn.watch import watching

grad = torch.arange(8.0) + 8 * rank  # rank r: [8r, ..., 8r + 7]
print(grad.int().tolist())

# %% [markdown]
# All-reduce sums the four gradients, in place, on every rank:

# %% tags=["live"]
# %%ranks
summed = grad.clone()
with watching() as ledger:  # the ledger counts the collectives called inside
    ledger.reset()  # this section's only
    dist.all_reduce(summed)
print(summed.int().tolist())

# %% [markdown]
# Reduce-scatter also sums them, but leaves rank r only the r-th quarter of the sum:

# %% tags=["live"]
# %%ranks
chunk = torch.empty(8 // world_size)
with watching():
    dist.reduce_scatter_single(chunk, grad.clone())  # (output, input): 8 elements in, 2 out
print(chunk.int().tolist())

# %% [markdown]
# All-gather hands every rank's chunk to every rank. Predict what each rank holds after it:

# %% tags=["live"]
# %%ranks
gathered = torch.empty(8)
with watching():
    dist.all_gather_single(gathered, chunk)  # (output, input): 2 elements in, 8 out
counts = ledger.as_dict()  # this rank's count of the three calls
print(gathered.int().tolist(), "equals the all-reduce:", torch.equal(gathered, summed))

# %% [markdown]
# The same three moves as a picture, drawn from the values the ranks hold (`pull` fetches a
# variable from every rank, in rank order):

# %%
from zerolearn import live

ranks = live.current()
ch01.collectives_figure(ranks.pull("grad"), ranks.pull("chunk"), ranks.pull("gathered"))
plt.show()

# %% [markdown]
# **How much does an all-reduce move?** Step through a ring all-reduce on four ranks, with
# the buttons under the picture (in JupyterLab, `ring.widget()` gives a play button and a
# slider). Watch which chunk each rank sends, and that every message is one chunk:

# %%
ring = schematics.ring_animation(nd=4)
HTML(ring.html)

# %% [markdown]
# A ring all-reduce runs exactly the two phases measured above. In the
# reduce-scatter, each of N<sub>d</sub> − 1 steps passes one chunk of Ψ/N<sub>d</sub> elements to
# the next rank, which adds its own; in the all-gather, N<sub>d</sub> − 1 more steps pass the
# finished chunks around. Each rank sends 2 (N<sub>d</sub> − 1)/N<sub>d</sub> · Ψ elements, which
# the paper rounds to **2 Ψ** per rank (Sec 7.1), independent of N<sub>d</sub>. On four ranks
# that is 3 + 3 = 6 steps, one frame each, and a last frame with the result.
#
# The ledger counts each call's full logical tensor (the input of a reduce-scatter, the output of
# an all-gather, the tensor of an all-reduce), so the paper's volume is
# 2 · all_reduce + reduce_scatter + all_gather. Here rank 0's ledger: one all-reduce and one
# reduce-scatter + all-gather pair of the same 8 elements:

# %%
ledger = ranks.pull("counts")[0]
ops = ("all_reduce", "reduce_scatter", "all_gather")
print(text_table(["rank 0", "calls", "elements", "bytes"], [[op, *ledger[op].values()] for op in ops],
                 align=["left", "right", "right", "right"]))
volume = {op: ledger[op]["elements"] for op in ops}
print(f"\nvolume of the all_reduce:              2 x {volume['all_reduce']} = {2 * volume['all_reduce']} elements")
print(f"volume of reduce_scatter + all_gather: {volume['reduce_scatter']} + {volume['all_gather']} = "
      f"{volume['reduce_scatter'] + volume['all_gather']} elements")

# %% [markdown]
# Live ranks suit short experiments typed cell by cell; they wait, idle, until `%ranks stop`,
# `live.stop()` or the end of the kernel. These four are done:

# %%
live.stop()  # the four processes exit and give their memory back
print(live.current())

# %% [markdown]
# A whole training run is the script again, from a function:
# `zerolearn.dist.launch(fn, world_size, *args)` spawns `world_size` fresh processes, runs
# `init_process_group` in each, calls `fn(*args)`, tears the group down and returns the
# results in rank order. The function travels to the ranks by value (cloudpickle), closures and
# lambdas included. This one reads `scale`, a variable of this notebook:

# %%
scale = 10.0


def scaled_sum():
    t = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(t)  # 10 + 20 + 30 on every rank
    return dist.get_rank(), t.item()


print(launch(scaled_sum, 3))
print(launch(lambda: dist.get_world_size() * scale, 2))

# %% [markdown]
# ## 3. Naive data parallelism
#
# The simplest DP: run forward and backward on this rank's slice of the batch, then all-reduce
# each parameter's gradient and divide by N<sub>d</sub>, so every rank holds the gradient of the
# *global* batch; then step. The replicas must start identical. Our ranks build the model from
# the same seed, which gives that; PyTorch's DDP does not rely on it. When it wraps a model it
# broadcasts rank 0's parameters and buffers to every rank, so replicas built from other seeds,
# or loaded from other files, start as one.
#
# Your functions may use `torch`, `nn`, `F` and `dist` besides their arguments; the next cell
# imports them.

# %%
import torch.nn.functional as F  # noqa: F401 - for the exercises' functions
from torch import nn  # noqa: F401

# %% [markdown]
# ### Exercise 2: rank 0's model on every rank
#
# Write `broadcast_model(model)`, DDP's start-up: on return every rank's parameters and buffers
# hold rank 0's values, in the same tensors (an optimizer built before still steps them). A
# module's state is its parameters and its *buffers* (`model.buffers()`: BatchNorm's running
# statistics, which no optimizer steps). `dist.broadcast(tensor, src=0)` sends rank 0's `tensor`
# and writes it, in place, into every other rank's `tensor`.
#
# The checker builds a small BatchNorm network from another seed on each of 2 and then 3 ranks,
# with an optimizer over it, calls your function, and compares every parameter and buffer with
# rank 0's; then it reads the ledger: every element moved once.

# %% tags=["exercise"]
# exercise: 01.broadcast_model

# %%
exercises.check("01.broadcast_model", broadcast_model)

# %% [markdown]
# ### Exercise 3: average the gradients
#
# Write `average_gradients(model, world_size)`, the heart of naive DP: called on every rank after
# `loss.backward()`, it replaces each parameter's `p.grad` by the mean of that gradient over the
# ranks, in place, with `dist.all_reduce(tensor)` (which sums `tensor` over the ranks, in place).
#
# `exercises.check` runs your function on 2 and then 3 real gloo ranks. Each rank trains a small
# GPT (Ψ = 42,368 in 29 tensors) with Adam for three steps on its slice of a global batch of 12
# sequences and calls your function after backward; the checker compares every gradient, and
# after the optimizer step every parameter, with the same GPT trained in one process on the whole
# batch, then reads the ledger: averaging the gradients moves 2 Ψ per step. A wrong result is
# named by rank, step and tensor.

# %% tags=["exercise"]
# exercise: 01.average_gradients

# %%
exercises.check("01.average_gradients", average_gradients)

# %% [markdown]
# `naive_dp_step` does this inside a whole training step, on the same GPT, which the rest of the
# chapter trains:

# %%
from zerolearn.exercises.helpers import GPT  # GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)

BATCH, LR = 12, 1e-3  # global batch (sequences per step), Adam's learning rate


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def naive_dp_step(model, optimizer, x, y, world_size):
    """One step on this rank's slice x, y of the global batch; returns this rank's loss."""
    loss = gpt_loss(model(x), y)
    loss.backward()
    for p in model.parameters():  # one blocking collective per tensor, after backward
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()

# %% [markdown]
# Naive DP is correct but wasteful twice over. Communication starts only after the whole backward
# is done, though the last layer's gradients were ready at its very beginning. And every tensor
# pays a collective's fixed start-up cost, however small it is: a LayerNorm bias of 32 elements
# waits for its own round trip just like a weight matrix.
#
# The fix is a schedule. Below is one DP backward of chapter 2's wider GPT (width 128, 2 blocks,
# fp32, 2 ranks: large enough to fill 12 buckets of at most 0.25 MiB), one colour per bucket. The
# top panel is the ideal, from the package's cost model (`zerolearn.costmodel`, chapter 6): backward
# computes the last layers' gradients
# first, and each bucket's all-reduce starts the moment its last gradient is in. The bottom
# panel is what this machine recorded; the timeline at the end of this section reads it.
# Look at the top panel: the reductions start long before backward ends.

# %%
schematics.bucket_schedule_figure(stage=0)

# %% [markdown]
# **Buckets from autograd hooks.** Real implementations (PyTorch DDP, DeepSpeed, and our engines)
# lay the gradients out in a few flat *buckets* of bounded size, fill them as backward produces
# gradients, and launch each bucket's reduction asynchronously the moment it is complete, while
# backward goes on with earlier layers.

# %% [markdown]
# ### Exercise 4: buckets from hooks
#
# Write `bucket_hook(buckets, world_size)`. `buckets` is a list of buckets, each a list of the
# model's parameters (every parameter in exactly one). Register a hook on every parameter with
# `p.register_post_accumulate_grad_hook(hook)`: autograd calls `hook(p)` with the *parameter*
# once `p.grad` is complete. When a bucket's last gradient has arrived, copy the bucket's
# gradients into one flat buffer and launch `dist.all_reduce(buffer, async_op=True)` at once,
# keeping the work handle it returns (its `.wait()` blocks until the sum is there). Return a
# function `finish()` that the caller runs after `loss.backward()`: it waits for every handle,
# divides by `world_size` and copies each averaged gradient back into `p.grad`.
#
# The checker trains the GPT of Exercise 3 on 2 and 3 ranks with five buckets of at most 48 KiB,
# in reverse parameter order (the order backward produces gradients). Besides every gradient and
# parameter against one process, it counts the all-reduces: one per bucket per step, each
# launched during backward, 2 Ψ in all.

# %% tags=["exercise"]
# exercise: 01.bucket_hook

# %%
exercises.check("01.bucket_hook", bucket_hook)

# %% [markdown]
# The engine does the same with the bookkeeping a library needs (gradient accumulation, shared
# parameters, a bound on the buffers in flight). Its constructor registers
# a hook on every parameter that calls `self._on_grad(b, i, p)` (bucket `b`, position `i`;
# through a weak reference, so the hooks do not keep a finished engine alive), and autograd
# calls it once the parameter's gradient for this backward is complete. The lines that matter:

# %%
excerpt(Engine._on_grad, ("def _on_grad", "def _on_grad"), ("view = b.grad_view(i)", "self._on_bucket_ready(b)"))

# %% [markdown]
# The gradient is copied into its bucket's flat buffer (added, when accumulating) and
# autograd's copy is dropped. When a bucket has all its gradients, `_on_bucket_ready` launches
# it, and every earlier bucket that is also complete, in one fixed order: collectives must be
# issued in the same order on every rank, or they pair up wrongly. The launch:

# %%
excerpt(Engine._launch)

# %% [markdown]
# `_launch` divides by N<sub>d</sub> before the sum (so fp16 gradients cannot overflow in the sum)
# and keeps at most two reductions in flight (`MAX_IN_FLIGHT`; `_finish_oldest` waits for the
# oldest), which bounds the gradient buffers alive at once. For DP, `_reduce` is one line,
# `comm.all_reduce(b.grad_full, group=self.pg, async_op=True)`: `zerolearn.comm` calls
# `dist.all_reduce` and adds what a library needs, a ledger entry, an error naming a dead or
# stuck rank, and a wait until gloo lets go of the buffer (so memory measured right after is the
# same on every run). With a reduce-scatter instead, the same hooks are ZeRO-2's (Sec 5.2).
#
# ### Three DP implementations against one process
#
# `compare_dp` trains the same GPT for five steps with naive DP, with the book's stage-0
# engine (buckets of at most 0.05 MiB, four for this GPT) and with PyTorch's
# `DistributedDataParallel`, each on 4 ranks with a global batch of 12 sequences of 16 bytes,
# fp32 Adam. `single_process` trains it in this process on the whole global batch. First a step
# of each kind:

# %%
def plain_step(model, optimizer, x, y):
    """Forward, backward, Adam: one process, or torch's DDP (its hooks reduce during backward)."""
    loss = gpt_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def engine_step(engine, x, y):
    loss = gpt_loss(engine(x), y)
    engine.backward(loss)  # buckets are all-reduced from hooks during backward
    engine.step()
    engine.zero_grad()
    return loss.item()


# %% [markdown]
# Every run starts from the same seed; each rank trains on its slice of the same global batches:

# %%
from functools import partial

from torch.nn.parallel import DistributedDataParallel

from zerolearn import data
from zerolearn.engines import make_engine


def rank_batch(step):
    x, y = data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return data.rank_slice(x, rank, world_size), data.rank_slice(y, rank, world_size)


# %%
def dp_run(kind, bucket_mb):
    """A step function (x, y) -> this rank's loss, and the engine's bucket count (else None)."""
    model = build_model("gpt", 0, gpt=GPT)
    if kind == "engine":
        engine = make_engine(0, model, optimizer="adam", lr=LR, bucket_mb=bucket_mb)
        return partial(engine_step, engine), len(engine.buckets)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    if kind == "torch_ddp":
        return partial(plain_step, DistributedDataParallel(model), optimizer), None
    return partial(naive_dp_step, model, optimizer, world_size=dist.get_world_size()), None


# %% [markdown]
# `compare_dp` runs the three on every rank, one after the other; `single_process` is the
# reference:

# %%
def compare_dp(steps=5, bucket_mb=0.05):
    """The three DP versions on this rank, one after the other: global losses, ledger, step time."""
    out = {}
    for kind in ("naive", "engine", "torch_ddp"):
        step_fn, buckets = dp_run(kind, bucket_mb)
        comm.LEDGER.reset()  # this version's collectives only
        losses, seconds = ch01.watched_steps(step_fn, rank_batch, steps)  # dist.all_reduce calls booked
        out[kind] = {"losses": losses, "ledger": comm.LEDGER.as_dict(), "buckets": buckets,
                     "step_seconds_median": seconds}
    return out


# %%
def single_process(steps=5):
    """The reference: one process, the whole global batch, fp32 Adam."""
    model = build_model("gpt", 0, gpt=GPT)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return [plain_step(model, optimizer, *data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)) for step in range(steps)]


# %%
steps = 5
dp = launch(compare_dp, 4, steps)[0]  # every rank returns the same global losses
reference = single_process(steps)
runs = {"one process": reference, **{name: dp[name]["losses"] for name in ("naive", "engine", "torch_ddp")}}
rows = [[step, *(f"{losses[step]:.4f}" for losses in runs.values())] for step in range(steps)]
print("global mean loss per step (cross-entropy, nats per byte)\n")
print(text_table(["step", *runs], rows))
worst = max(abs(a - b) for losses in runs.values() for a, b in zip(losses, reference, strict=True))
print(f"\nevery DP run matches one process to within 1e-5 at every step: {worst < 1e-5}")

# %%
psi = sum(p.numel() for p in build_model("gpt", 0, gpt=GPT).parameters())
rows = [[f"all_reduce {what}", *(dp[name]["ledger"]["all_reduce"][what] // steps for name in ("naive", "engine"))]
        for what in ("calls", "elements")]
print(text_table(["per step", "naive", "engine"], rows, align=["left", "right", "right"]))
print(f"\nthe engine's buckets: {dp['engine']['buckets']}; both all-reduce Psi = {psi:,} elements per step")

# %% [markdown]
# Both all-reduce the same Ψ elements per step (2 Ψ of traffic, Sec 7.1); the naive version needs 29
# calls for it, the engine 4.
# The losses agree to the printed digits: data parallelism changes where the arithmetic runs, not
# what it computes. (The last digits differ a little, because a sum over ranks adds the same
# numbers in another order than one process does.) The timings below are run-dependent and not
# a benchmark, but the naive version is usually the slowest by a clear margin:

# %% tags=["nbval-ignore-output"]
for name in ("naive", "engine", "torch_ddp"):
    print(f"{name:<10} {dp[name]['step_seconds_median'] * 1e3:7.1f} ms per step (median, 4 ranks on this CPU)")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for (name, losses), marker in zip(runs.items(), "os^x", strict=True):
    ax.plot(range(steps), losses, marker=marker, ms=8 if marker == "o" else 6, label=name,
            ls="-" if name == "one process" else "none")
ax.set_xlabel("training step")
ax.set_ylabel("global mean loss (cross-entropy, nats per byte)")
ax.set_title("Same losses: one process and three DP implementations on 4 ranks")
ax.set_xticks(range(steps))
ax.legend()
plt.show()

# %% [markdown]
# ### Where the time goes: one step on a timeline
#
# The ledger counts what the all-reduces moved, not when. `zerolearn.timeline` records one
# training step on each rank with `torch.profiler`: compute (forward, backward, optimizer
# step), each collective from launch to completion (gloo runs it on a thread of its own, so
# an asynchronous all-reduce can run *under* backward), and the time the main thread blocks
# waiting. The run is the one drawn in the bucket schedule above: chapter 2's GPT (width 128,
# 2 blocks, fp32 Adam, 12 buckets of at most 0.25 MiB) on 2 ranks, wider than this chapter's
# GPT, so that backward has enough buckets to show their order. The results
# were stored by `python -m zerolearn.timeline --out notebooks/data/timeline/` (its
# `--traces DIR` also writes Chrome/Perfetto trace files); the counts are the same on every
# machine, the times are not.

# %%
from zerolearn import figures
from zerolearn.chapters import stored

TL = stored("timeline/stages.json")
stage0 = TL["stages"][0]
print(f"stage 0 on {TL['world_size']} ranks: {stage0['buckets']} gradient buckets")
for rank, ledger in enumerate(stage0["ledger"]):
    print(f"rank {rank}: " + ", ".join(f"{c['calls']} {op}" for op, c in ledger.items() if c["calls"])
          + f", {sum(c['bytes'] for c in ledger.values()):,} bytes")

# %%
figures.stage_timelines_figure(TL, stages=(0,))

# %% [markdown]
# The order is real: every bucket is launched from a hook during backward, last layers first,
# 12 all-reduces per step. The overlap a GPU gets is not: here the ranks and gloo's threads
# share two CPU cores ([appendix: what two CPU cores cannot show](../book/cpu_timelines.md)),
# and even the ideal schedule hides only part of the reductions:

# %%
sched = schematics.bucket_schedule(TL, stage=0)
compute_end = sched.ideal[-1][1]
reduced = sum(end - start for *_, start, end in sched.ideal)
hidden = sum(max(0.0, min(end, compute_end) - start) for *_, start, end in sched.ideal)
print(f"backward compute {sched.compute_s * 1e3:.1f} ms, its all-reduces {sched.comm_s * 1e3:.1f} ms (rank 0)")
print(f"ideal: {hidden * 1e3:.1f} ms of {reduced * 1e3:.1f} ms hidden ({hidden / reduced:.0%}); "
      f"backward ends at {sched.ideal[-1][3] * 1e3:.1f} ms")
print(f"measured: backward ends at {sched.backward_s * 1e3:.1f} ms")

# %% [markdown]
# The *overlap* measured is the fraction of communication time during which the main thread
# was computing (defined in `zerolearn.timeline.intervals`). It is below the ideal's, and it
# differs between the ranks: the reductions pair up, so a rank that reaches one first blocks
# until the other rank's part arrives.

# %% tags=["nbval-ignore-output"]
for r in stage0["summary"]:
    b = r["phases"]["backward"]
    print(f"rank {r['rank']}: all-reduces in flight {b['comm_s'] * 1e3:.1f} ms during backward, "
          f"{b['overlap']:.0%} of that hidden behind compute; main thread blocked {b['wait_s'] * 1e3:.1f} ms")

# %% [markdown]
# (Models with BatchNorm also keep running statistics in *buffers*, which every engine here
# broadcasts from rank 0 before each forward, as torch's DDP does; `docs/USAGE.md` says more.
# Our GPT has none.)
#
# ## 4. The redundancy: every rank holds 16 Ψ
#
# Now the memory side. We run the training command line at stage 0 (DP) with mixed-precision
# Adam (bf16 working copies, K = 12) on N<sub>d</sub> = 1, 2 and 4 ranks and read, from each
# rank's report, the bytes it holds, measured from its tensors, beside the paper's formula
# (2 + 2 + K) Ψ (Sec 3.1, Fig 1 baseline).

# %%
from zerolearn.config import TrainConfig
from zerolearn.report import kib, volume_per_step
from zerolearn.train import train

run = TrainConfig(stage=0, dtype="bf16", optimizer="adam", d_model=GPT.d_model, n_layer=GPT.n_layer,
                  n_head=GPT.n_head, seq_len=GPT.seq_len, global_batch_size=BATCH, steps=3, bucket_mb=0.05)
dp_reports = {nd: launch(train, nd, run)[0] for nd in (1, 2, 4)}

# %%
psi, cats = dp_reports[1]["num_params"], ("params", "grads", "optimizer_states")
formula = dp_reports[1]["analytic"]["model_state_bytes"]
rows, exact = [], True
for nd, report in dp_reports.items():
    for entry in report["ranks"]:
        held = entry["model_state_bytes"]
        exact = exact and all(held[c] == report["analytic"]["model_state_bytes"][c] for c in cats)
        rows.append([nd, entry["rank"], *(kib(held[c]) for c in cats), kib(sum(held.values())),
                     f"{volume_per_step(entry, len(report['losses'])) / psi:.3f}"])
rows.append(["formula", "", *(kib(formula[c]) for c in cats), kib(sum(formula[c] for c in cats)),
             f"{analytic.comm_volume_elements(psi, stage=0) / psi:.1f}"])  # Sec 3.1, Sec 7.1
print(f"stage 0, bf16 Adam, psi = {psi:,}: KiB held per rank; communication per step in units of Psi\n")
print(text_table(["Nd", "rank", "params", "grads", "optim. states", "total", "comm Psi/step"], rows))
print(f"\nmeasured == formula in every category on every rank: {exact}")

# %% [markdown]
# Every rank holds the same 662.0 KiB = 16 Ψ bytes at every N<sub>d</sub>, exactly the formula,
# and the ledger counts 2 Ψ elements per step (one all-reduce of Ψ, counted twice). At
# N<sub>d</sub> = 1 the all-reduce has no peer and the ring would send nothing,
# (N<sub>d</sub> − 1)/N<sub>d</sub> = 0; the ledger still counts the call. Adding ranks divides the
# batch, not the memory:

# %%
one_copy = analytic.model_state_bytes(psi, nd=1, stage=0, k=12)["total"] / 1024  # KiB, 16 psi
ch01.redundancy_figure(dp_reports, one_copy)
plt.show()

# %% [markdown]
# The right panel is the redundancy ZeRO removes: N<sub>d</sub> ranks hold N<sub>d</sub> identical
# copies of the parameters, the gradients and, the largest part, the optimizer states (Sec 4).
# Each rank then runs the same optimizer step on the same numbers. ZeRO-1 (chapter 2) gives each
# rank 1/N<sub>d</sub> of the optimizer states and of the step, keeping DP's 2 Ψ of communication
# (Sec 5.1, Sec 1, Sec 7).
#
# ## 5. Your engine trains
#
# `zerolearn/nano.py` (under 300 lines, to be read top to bottom) assembles ZeRO-DP's four
# stages from the book's exercises. At stage 0 it is your `bucket_hook`, with all the
# parameters in one bucket, and one Adam step on the averaged gradient:

# %%
from zerolearn.nano import NanoZero

excerpt(NanoZero, ("if stage == 0:", 'self.fn["bucket_hook"]'), ("loss.backward()", "self.finish()"))

# %% [markdown]
# The next cell trains the exercises' GPT (Ψ = 42,368) with it on 2 ranks, beside one process
# and the package's stage-0 engine. Look for the same losses as one process, 2 Ψ moved per step,
# and the bytes per rank of Fig 1 on both. The step is chapter 2's `zero1_step` (the book's, for
# now), which keeps an fp32 master copy even in fp32: K = 12 for yours, 8 for the package's.

# %%
from zerolearn.chapters.your_engine import your_engine

your_engine(0, {"bucket_hook": bucket_hook})

# %% [markdown]
# What the package's engine adds at stage 0:
#
# | addition | why | where |
# |---|---|---|
# | buckets of a bounded size | reduce during backward (one bucket of all waits for its end) | section 3; ch. 5 (CB) |
# | two reductions in flight at most | bounds the gradient buffers alive at once | `_launch` above |
# | bf16/fp16 copies, fp32 master, loss scale | 2-byte forward and backward; (2 + 2 + K) Ψ of states | chapter 0 |
# | gradient accumulation | several micro-batches, one reduction per step | chapter 3, section 6 |
# | buffers broadcast from rank 0 | BatchNorm statistics the same on every rank | `docs/USAGE.md` |
# | guards that keep ranks in step | collectives pair by order: a skipped one hangs the rest | chapter 7, pitfalls |

# %% [markdown]
# ## Summary
#
# * A DP program is one script on N<sub>d</sub> processes: `torchrun` starts them,
#   `dist.init_process_group` joins them, `dist.all_reduce` sums over them.
# * All-reduce = reduce-scatter + all-gather, shown on 4 live gloo ranks. A ring all-reduce
#   sends 2 (N<sub>d</sub> − 1)/N<sub>d</sub> · Ψ elements per rank, the paper's 2 Ψ (Sec 7.1).
# * Naive DP (one blocking all-reduce per tensor after backward) pays one latency per tensor and
#   overlaps nothing. Real DP reduces constant-size buckets from `post_accumulate_grad` hooks as
#   soon as each is full (29 calls per step became 4 for our GPT).
# * Naive DP, our bucketed engine and PyTorch's DDP all reproduce single-process training on the
#   global batch to within 1e-5 (sums over ranks add in another order).
# * On two CPU cores the recorded timeline shows the buckets' order, not a GPU's overlap
#   ([appendix](../book/cpu_timelines.md)).
# * Every DP rank holds all (2 + 2 + K) Ψ = 16 Ψ bytes of model states, measured at
#   N<sub>d</sub> = 1, 2 and 4: adding GPUs adds copies, not room.
#
# Next, chapter 2 partitions the optimizer states (P<sub>os</sub>, Sec 5.1): 4 Ψ + K Ψ/N<sub>d</sub>
# per rank, for the same 2 Ψ of communication.

# %% [markdown]
# ## Questions
#
# Write your prediction down before you run each cell.
#
# **1.** A ring all-reduce of our GPT's gradients on N<sub>d</sub> = 8 ranks: how many elements
# does each rank send, and what does the paper round it to?

# %%
nd = 8
print(f"each rank sends 2 (Nd - 1)/Nd x Psi = {2 * (nd - 1) * psi // nd:,} elements; "
      f"the paper's 2 Psi = {analytic.comm_volume_elements(psi, stage=0):,}")

# %% [markdown]
# **2.** Same training, buckets of at most 0.25 MiB: how many all-reduce calls per step do naive
# DP and the engine make on 2 ranks? (Our GPT's gradients take 165.5 KiB in fp32.)

# %%
counted = launch(compare_dp, 2, 1, 0.25)[0]  # one step of each version, buckets of 0.25 MiB
print({name: counted[name]["ledger"]["all_reduce"]["calls"] for name in ("naive", "engine")})

# %% [markdown]
# **3.** With bf16 Adam on N<sub>d</sub> = 8 ranks, how many KiB of model states does each rank
# hold, and all eight together?

# %%
per_rank = analytic.model_state_bytes(psi, nd=8, stage=0, k=12)["total"]
print(f"each rank {kib(per_rank, unit=True)}, all 8 ranks {kib(8 * per_rank, unit=True)}")

# %% [markdown]
# **4.** GPT-2 1.5B in plain DP on 64 GPUs: predict the GB of model states all 64 hold together,
# and the elements each GPU moves per step.

# %%
total = 64 * analytic.model_state_bytes(1.5e9, nd=64, stage=0, k=12)["total"]
print(f"{total / analytic.GB:,.0f} GB on 64 GPUs; "
      f"{analytic.comm_volume_elements(1.5e9, stage=0) / 1e9:.1f}B elements per GPU per step")
