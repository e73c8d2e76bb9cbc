# %% [markdown]
# # Chapter 5 · ZeRO-R: the memory that is left
#
# ZeRO-DP removes the redundant copies of model states. What remains on each GPU is the
# *residual* memory of Sec 3.2: activations, temporary buffers and fragmentation. The
# paper's second pillar, ZeRO-R (Sec 6), attacks all three. This chapter runs each of its
# pieces for real on 4 gloo ranks, arranged as $N_d \times N_m = 2 \times 2$: two
# data-parallel groups, each splitting every transformer block across two ranks. The
# model is the book's GPT of the exercises (Psi = 42,368); its 2 attention heads split
# over $N_m = 2$ ranks, one head each.

# %% [markdown]
# **Learning goals.** After this chapter you can
#
# 1. explain activation checkpointing and measure what it saves (Sec 3.2);
# 2. write Megatron-style tensor parallelism for an MLP's two layers, a column-parallel
#    one and a row-parallel one with their all-reduces, and check that it gives one
#    process's outputs and gradients;
# 3. write $P_a$ (Sec 6.1) and measure it: checkpoint bytes per rank divided by $N_m$, for
#    one extra all-gather per block that costs about 1/12 of the model parallelism's own
#    traffic (Sec 8); and $P_{a+cpu}$, which moves checkpoints to host memory;
# 4. show why fused buffers must have a constant size, and write one (CB, Sec 6.2);
# 5. reproduce, by replaying real training steps through a model of the caching allocator,
#    an out-of-memory error with much of memory still free, as the paper observed (over
#    30% still available, Sec 3.2), and its cure by contiguous pools (MD, Sec 6.3).

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
from IPython.display import display

from zerolearn.chapters.ch05 import lesson as ch05
from zerolearn.chapters.source import excerpt
from zerolearn.dist import launch
from zerolearn.memory import model as analytic
from zerolearn.residual import checkpointing, defrag
from zerolearn.residual.tensor_parallel import ParallelAttention
from zerolearn.tables import kib, text_table

cfg, batch = ch05.GPT, ch05.BATCH
print(f"GPT: {cfg.n_layer} blocks, hidden {cfg.d_model}, {cfg.n_head} heads, seq {cfg.seq_len}; "
      f"global batch {batch}")

# %% [markdown]
# ## 1. Tensor parallelism in two layers
#
# First the picture, drawn from the package's own layers: one 6 × 4 weight split over
# N<sub>m</sub> = 2 ranks, coloured by the rank that keeps each block. Look at the direction
# of the cut, rows in the left panel, columns in the middle one, and at the autograd function
# under each: it says where that layer communicates. The right panel is $P_a$, section 2's
# subject: a checkpoint cut into N<sub>m</sub> pieces, gathered again before recomputation.

# %%
from zerolearn.figures import schematics

schematics.megatron_figure(nm=2)

# %% [markdown]
# Model parallelism splits each layer across $N_m$ ranks. Megatron-LM's recipe needs two
# kinds of Linear layer. A *column-parallel* layer keeps $1/N_m$ of the output features:
# every rank sees the same input, so forward needs no communication, and backward sums
# the input gradient over the group. A *row-parallel* layer keeps $1/N_m$ of the input
# features: its partial outputs are summed with an all-reduce in forward. Attention is
# column-parallel by heads, then row-parallel for the output projection; the MLP is
# column-parallel, GELU, row-parallel.
#
# Before reading the package's version, write the split yourself. Each exercise is a
# function with a stated signature; `exercises.check` runs it on real gloo ranks and
# compares it with plain training in one process and with the communication and memory
# ledgers. Besides their arguments, exercise functions may use the names the next cell
# imports.

# %%
import torch  # noqa: F401 - for the exercises' functions
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from torch import nn  # noqa: F401

from zerolearn import comm, exercises  # noqa: F401

# %% [markdown]
# ### Exercise 1 · tensor parallelism
#
# Write `tensor_parallel(fc, proj, group, nm, rank)`, which splits an MLP's two layers,
# `fc = nn.Linear(d, h)` and `proj = nn.Linear(h, d)`, over the `nm` ranks of `group`
# and returns `(column, row)`, two modules such that `row(F.gelu(column(x)))` equals
# `proj(F.gelu(fc(x)))`. `column` keeps this rank's rows of `fc`'s weight and bias (its
# output features); `row` keeps the same columns of `proj`'s weight (its input features)
# and the whole bias, added once after the sum. Each needs an autograd function of its
# own: before `column`, the identity in forward and `dist.all_reduce` of the gradient in
# backward; after `row`, the reverse. The checker splits a block of 16 -> 32 -> 16 over
# groups of $N_m = 2$, on 2 ranks and on $2 \times 2$, and compares the output and every
# gradient with the whole block in one process for three steps; it counts one
# all-reduce in forward and one in backward.

# %% tags=["exercise"]
# exercise: 05.tensor_parallel

# %%
exercises.check("05.tensor_parallel", tensor_parallel)

# %% [markdown]
# The package's layers are the same two, their all-reduces tagged `"tp"` so the ledger
# counts model parallelism's traffic apart. Attention uses them too: the column-parallel
# `qkv` keeps the q, k and v rows of this rank's heads, the row-parallel `proj` the
# matching columns, so each rank attends with $1/N_m$ of the heads:

# %%
excerpt(ParallelAttention.__init__, ("heads, head_dim", "self.proj ="))

# %% [markdown]
# Each rank's slices are cut from the full model built from the same seed, so the
# $2 \times 2$ world starts from exactly the parameters of a single process. We train
# every variant of this chapter on 4 ranks (ZeRO-2 over the data-parallel groups) and the
# plain model on one rank, and compare the losses.

# %%
VARIANTS = ch05.VARIANTS
for name, kwargs in VARIANTS.items():
    print(f"{name:<24} {kwargs}")
single = launch(ch05.zero_r_runs, 1, [dict(stage=2)])[0][0]
runs = dict(zip(VARIANTS, launch(ch05.zero_r_runs, 4, [dict(stage=2, **kw) for kw in VARIANTS.values()])[0],
                strict=True))
rows = [[name, *(f"{x:.4f}" for x in r["losses"])] for name, r in {"1 rank, Nm = 1": single, **runs}.items()]
print(text_table(["run", "loss@0", "loss@1", "loss@2"], rows, align=["left", "right", "right", "right"]))
same = all(abs(a - b) <= 1e-5 * abs(b) for r in runs.values()
           for a, b in zip(r["losses"], single["losses"], strict=True))
print("all equal to the single process within 1e-5:", same)

# %% [markdown]
# ## 2. Activation checkpointing and $P_a$
#
# Without checkpointing, each block keeps every intermediate its backward needs. With
# it, a block keeps only its input, $b \times s \times h$ values (the *checkpoint*), and
# recomputes the rest in backward, about a third more compute (Sec 3.2). Under model
# parallelism every rank of the group keeps the *same* checkpoint. $P_a$ keeps $1/N_m$ of
# it per rank and all-gathers it just before the recomputation; $P_{a+cpu}$ parks that
# part in host memory.

# %% [markdown]
# ### Exercise 2 · a partitioned checkpoint
#
# Write `partition_checkpoint(x, group)`. `x` is a checkpointed block's input (fp32,
# any shape), the same on the $N_m$ ranks of `group`. Keep only this rank's piece:
# elements $r c$ to $(r + 1) c - 1$ of `x` flattened and zero-padded at the end, with
# $c = \lceil n / N_m \rceil$ for $n$ = `x.numel()`, and no reference to `x` or to a
# view of it. Return `restore()`, a function that all-gathers the pieces with one
# `dist.all_gather_single(output, piece, group=group)` and returns a tensor equal to `x`;
# backward calls it just before recomputing the block. The checker trains three
# checkpointed blocks whose input, 31 x 61 = 1,891 values, splits unevenly over 2 and 3
# ranks (here all ranks form one model-parallel group, so $N_m$ is the world size); it
# compares every restored checkpoint with the block's input in forward and the
# gradients with plain training, measures the bytes alive after forward with the
# memory ledger (1/$N_m$ of each checkpoint) and counts the elements gathered.

# %% tags=["exercise"]
# exercise: 05.partition_checkpoint

# %%
exercises.check("05.partition_checkpoint", partition_checkpoint)

# %% [markdown]
# The package's store cuts every block's checkpoint the same way, then keeps the piece in
# one of three places: in host memory ($P_{a+cpu}$), in a contiguous pool reserved before
# the first forward (MD, Section 4), or, when partitioned, in a copy of its own, so that
# it does not pin the whole checkpoint. `load` brings a host piece back, then all-gathers.

# %%
excerpt(checkpointing.CheckpointStore.save, ("if self.cpu:", "held = flat.clone()"))

# %%
local_batch = batch // 2  # Nd = 2
formula = analytic.activation_bytes(cfg.d_model, local_batch, cfg.seq_len, cfg.n_layer, bytes_per_value=4,
                                    checkpointing=True)
print(f"one fp32 checkpoint per block (Sec 6.1, Sec 8): {formula / 1024:.1f} KiB per rank; with P_a, / Nm = 2: "
      f"{formula / 2 / 1024:.1f} KiB\n")
rows = [[name, kib(r["checkpoint_bytes"][0]), kib(r["checkpoint_bytes"][1]), kib(r["activation_bytes"])]
        for name, r in runs.items()]
print(text_table(["run", "ckpt device KiB", "ckpt host KiB", "activations KiB"], rows,
                 align=["left", "right", "right", "right"]))

# %% [markdown]
# The checkpoint column matches the formula exactly: $b s h$ values per block, halved by
# $P_a$, moved to the host by $P_{a+cpu}$ (on this CPU-only machine "host" and "device"
# are the same memory; on a GPU the device column is what the GPU keeps). The contiguous
# variant shows its pool, reserved once for all blocks. The activations column is
# everything the ledger saw allocated in forward and still alive at its end: the
# checkpoints, plus the embedding and the head, which are not checkpointed. At the
# paper's scale the same count is what makes $P_a$ matter: a 100B-parameter-class block
# (hidden 8192) at batch 4 and sequence 1024 in fp16 checkpoints 64 MiB per block, and
# at $N_m = 16$ each rank keeps 4 MiB of it.
#
# ### What $P_a$ costs
#
# Each block's model parallelism all-reduces $b s h$ values twice in forward and twice
# in backward, and twice more when checkpointing recomputes the forward: six
# all-reduces, $12\,b s h$ elements of traffic in the paper's count (an all-reduce moves
# twice its size). $P_a$ adds one all-gather of $b s h$ per block (Sec 8):

# %%
pa = runs["+ P_a"]["by_tag"]
tp_elements = pa["tp"]["all_reduce"]["elements"]
pa_elements = pa["pa"]["all_gather"]["elements"]
measured = pa_elements / (2 * tp_elements)
theory = analytic.pa_overhead_ratio(cfg.seq_len, local_batch, cfg.d_model)
print(f"MP all-reduce elements, 3 steps: {tp_elements:,} (paper's volume: {2 * tp_elements:,})")
print(f"P_a all-gather elements, 3 steps: {pa_elements:,}")
print(f"P_a / MP traffic: measured {measured:.4f}, Sec 8: {theory:.4f}")

fig, ax = plt.subplots(figsize=(6, 3.2))
names = ["MP all-reduces", "P_a all-gathers"]
ax.bar(names, [2 * tp_elements / 3 / 1e3, pa_elements / 3 / 1e3], color=["tab:blue", "tab:orange"])
ax.set_ylabel("elements per step (thousands)")
ax.set_title("Traffic per rank per step, Nm = 2 (paper's count)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. CB: fused buffers of constant size
#
# Reducing gradients one tensor at a time wastes bandwidth, so implementations fuse
# them into one buffer. If that buffer grows with the model, it becomes a memory problem
# of its own: fusing all gradients of a 3B-parameter model in fp32 takes 12 GB (Sec 6.2).
# ZeRO caps it. Here every gradient reduction and parameter gather goes through flat
# groups of at most `--bucket-mb`; the sweep measures the largest buffer of one step with
# a cap of 0.25 MiB and with no cap ("fuse everything"). It uses an MLP of 6 layers whose
# width grows from 64 to 256, because only the model's size may change along the sweep.

# %%
sweep = launch(ch05.bucket_sweep, 1, [64, 128, 256], [0.25, 1e6])[0]  # one rank: the buffers, not the traffic
fig, ax = plt.subplots(figsize=(6, 3.4))
for cap, label in ((0.25, "cap 0.25 MiB"), (1e6, "fuse everything")):
    rows = [r for r in sweep if r["bucket_mb"] == cap]
    ax.plot([r["psi"] / 1e3 for r in rows], [r["peak"] / 2**20 for r in rows], "o-", label=label)
    for r in rows:
        print(f"{label:<16} psi = {r['psi']:>7,}: largest fused buffer {r['peak'] / 2**20:.3f} MiB "
              f"(fp32, 4 * psi = {4 * r['psi'] / 2**20:.3f} MiB)")
ax.set_xlabel("parameters (thousands)")
ax.set_ylabel("largest fused buffer (MiB)")
ax.set_title("CB: the buffer stays under the cap as the model grows")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Exercise 3 · a constant buffer
#
# Write `constant_buffer(tensors, buffer, world_size)`: average `tensors` (contiguous
# fp32 tensors of any shapes, a model's gradients, $n$ elements in all) over the ranks
# in place, using `buffer` (fp32, 1-D, $B$ elements) as the only fused buffer. Lay the
# tensors' elements end to end and take them $B$ at a time: copy each run into
# `buffer` (a tensor may span two runs, a run may hold pieces of several tensors),
# average the filled part with one `dist.all_reduce` and copy it back. The checker
# averages the gradients of two MLPs, of 3,095 and 17,201 values, through the same
# 1,024-element buffer; it compares the results with the average over ranks, counts the
# all-reduce calls ($\lceil n / B \rceil$) and measures, with the memory ledger, what
# your function allocates: nothing that grows with the model.

# %% tags=["exercise"]
# exercise: 05.constant_buffer

# %%
exercises.check("05.constant_buffer", constant_buffer)

# %% [markdown]
# ## 4. MD: out of memory with memory free
#
# Sec 6.3: in forward, a block's checkpoint lives until backward while the block's
# temporaries die at once; in backward, parameter gradients live until the step while
# recomputed activations and activation gradients die at once. Long-lived tensors end up
# scattered among short-lived ones and cut free memory into pieces, too small for the next
# large request. In extreme cases the paper saw out-of-memory errors with over 30% of
# memory still available (Sec 3.2). ZeRO's fix, MD, copies the long-lived tensors into
# pre-allocated contiguous pools.

# %% [markdown]
# To see it without a GPU we record where memory goes in real training and replay it. The
# book's GPT is far too small for this: fragmentation shows only when requests outgrow the
# allocator's segments. So `defrag.record_gpt_steps()` trains a GPT of 25.7M parameters (8
# blocks, hidden 512, seq 512, batch 8, real text) for two steps as plain data parallelism
# did before ZeRO: one checkpoint per block, a gradient per parameter wherever the
# allocator puts it, all gradients flattened into one buffer for the all-reduce, an Adam
# step. The ledger writes down every allocation and free. `defrag.replay` runs them through
# a model of torch's caching allocator: memory reserved from the device in segments (2 MiB
# ones for requests up to 1 MiB, 20 MiB ones up to 10 MiB, larger requests alone), best fit
# inside them, free blocks merging only within their segment, and, before a request is
# refused, every segment with nothing left in it given back. With MD, each class of
# long-lived tensors gets a pool of its own.

# %%
from zerolearn import figures

trace = figures.recorded_trace()
print(f"{len(trace)} allocations and frees in two steps; the long-lived tensors, by lifetime:")
print(ch05.lifetime_table(trace))
capacity = defrag.smallest_capacity(trace, md=True)
with_md, without_md = defrag.replay(trace, capacity, md=True), defrag.replay(trace, capacity, md=False)
print(f"device memory: {capacity / 2**20:.0f} MiB (the least that works with MD)")
print(f"with MD:    ok = {with_md.ok}")
print(f"without MD: ok = {without_md.ok}; in phase {trace[without_md.failed_event][3]!r} it asked for "
      f"{without_md.failed_bytes / 2**20:.0f} MiB with {without_md.free_bytes_at_failure / 2**20:.0f} MiB free "
      f"({without_md.free_fraction:.0%} of memory)")
print(f"without MD it needs {defrag.smallest_capacity(trace, md=False) / 2**20:.0f} MiB")

# %% [markdown]
# The request that fails is the flattened gradients, 98 MiB (4 bytes x 25.7M parameters).
# At that moment over 40% of memory is free, but the allocator cannot reserve a new
# segment that large: the segments it holds each keep a gradient, an optimizer state or a
# checkpoint alive somewhere inside, so none can be given back. The orange line is what the
# allocator holds; the blue one what tensors use; the purple one what MD would pool.

# %%
display(figures.fragmentation_figure(trace, capacity, md=False))
display(figures.fragmentation_figure(trace, capacity, md=True))

# %% [markdown]
# The simulator's MD moves the long-lived tensors into pools after the fact. The step can
# also do it itself, as ZeRO does: `record_gpt_steps(md=True)` copies each checkpoint into
# one pool reserved before the first forward (`CheckpointStore(contiguous=True)`) and lets every
# gradient accumulate into a view of one flat buffer allocated before training, which is
# also the buffer the all-reduce would send, so nothing is flattened. Replayed as it
# happened, with no simulated pools, that trace fits in the same memory:

# %%
real_md = defrag.record_gpt_steps(md=True)
replayed = defrag.replay(real_md, capacity, md=False)
print(f"MD in the step itself, in {capacity / 2**20:.0f} MiB: ok = {replayed.ok}; "
      f"least memory it needs: {defrag.smallest_capacity(real_md, md=False) / 2**20:.0f} MiB")

# %% [markdown]
# On a GPU, `defrag.cuda_memory(md=False)` and `defrag.cuda_memory(md=True)` run the same
# steps on CUDA and read torch's own allocator statistics (reserved, allocated and
# inactive-split bytes, `torch.cuda.memory_stats`); `python -m zerolearn.gpu_check` prints them.
#
# MD is not free: each pool is as large as its own class ever needs, and the checkpoints'
# pool is idle while the gradients' pool fills, where without MD the same memory would
# serve both. It pays when fragmentation costs more. Three GPTs, each recorded the same way;
# the first table gives the least memory each needs without and with MD, in MiB (in
# brackets, how far above the most bytes live at once), the second MD's pools against one
# pool shared by all long-lived tensors:

# %%
print(ch05.md_tables(ch05.md_comparison()))

# %% [markdown]
# Above the live peak, the allocator without MD pays for segments kept alive by the tensors
# pinned in them; with MD it pays for the pools' separation (MD pools minus one pool) and for
# the segments of the short-lived tensors. As the model grows, the first cost grows faster
# than the second, and at 8 blocks MD needs less memory than no MD; the paper met the
# failure on models far larger (Sec 3.2). `MemoryLedger(record_trace=True)` records any
# step you write; `defrag.replay` takes its trace.

# %% [markdown]
# ## 5. ZeRO-R at the paper's scale
#
# The view below puts this chapter's pieces together for one GPU of Sec 6.1's
# 100B-parameter example at sequence 1K and $N_m = 16$. The shape, 125 blocks of hidden
# 8192, is the book's (the paper lists its shapes in Table 4, an image), and so are
# $N_d = 64$ and ZeRO-2: Sec 6.1 gives neither. The paper states a batch of 32 per GPU;
# its about 33 GB of checkpoints per GPU is what the formula gives at batch 16 (at 32 it
# gives 67 GB, near Sec 3.2's about 60 GB for the same model: the paper's two figures
# disagree), so the view starts at 16. Checkpoints are replicated on every model-parallel
# rank, partitioned ($P_a$) or moved to the CPU ($P_{a+cpu}$); CB caps the fused buffer.
# Fragmentation is the book's model: without MD a share of the device is lost, 30% by
# default. The paper gives no such share: its over 30% (Sec 3.2) is memory still
# available at an out-of-memory error. Move **Nm**, the checkpoints' place, the CB size or
# MD, and compare the total with the device.

# %%
from zerolearn import widgets
from zerolearn.figures import formulas

display(widgets.ResidualExplorer())  # Sec 6.1's 100B example at Nm = 16; Nd = 64 and ZeRO-2 are the book's

# %%
fig = formulas.residual_figure()  # the default view, drawn for the book
fig.suptitle("Sec 6.1's 100B model in the book's shape, batch 16; Nd = 64 and P_os+g are the book's choices, "
             "the 30% lost without MD the book's model", fontsize=8)
fig

# %% [markdown]
# ## Questions
#
# Write down a number for each question, then run the cell under it.
#
# **1.** Train with a global batch of 16 instead of 8 ($N_d = 2$, so 8 sequences per
# data-parallel group) under $P_a$ at $N_m = 2$: how many KiB of checkpoints does rank 0
# keep on its device?

# %%
pa16 = launch(ch05.zero_r_runs, 4, [dict(stage=2, batch=16, **VARIANTS["+ P_a"])])[0][0]
print(f"rank 0's checkpoints on its device: {kib(pa16['checkpoint_bytes'][0], unit=True)}")

# %% [markdown]
# **2.** In that same run, what fraction of model parallelism's traffic did $P_a$'s
# all-gathers add, in the paper's count?

# %%
tp_elements = pa16["by_tag"]["tp"]["all_reduce"]["elements"]
pa_elements = pa16["by_tag"]["pa"]["all_gather"]["elements"]
print(f"P_a / MP traffic at global batch 16: {pa_elements / (2 * tp_elements):.4f}")

# %% [markdown]
# **3.** Sec 6.1's 100B model at the paper's batch of 32 per GPU: how many GB of
# checkpoints does a GPU keep, replicated and with $P_a$ at $N_m = 16$ (one checkpoint of
# $b s h$ 2-byte values per block, 125 blocks of hidden 8192, sequence 1,024)?

# %%
shape = dict(hidden=8192, layers=125, seq_len=1024)
replicated = analytic.activation_bytes(batch=32, checkpointing=True, **shape)
partitioned = analytic.partitioned_checkpoint_bytes(batch=32, nm=16, **shape)
print(f"batch 32: {replicated / 1e9:.1f} GB per GPU replicated, {partitioned / 1e9:.1f} GB with P_a")

# %% [markdown]
# ## Summary
#
# - Tensor parallelism splits each block across $N_m$ ranks with two all-reduces in
#   forward and two in backward; our $2 \times 2$ world trains exactly like one process.
# - Activation checkpointing keeps one $b s h$ checkpoint per block; $P_a$ divides it by
#   $N_m$ for one all-gather per block, 1/12 of model parallelism's traffic; $P_{a+cpu}$
#   moves it off the device.
# - CB keeps fused buffers at a constant size; MD keeps long-lived tensors in contiguous
#   pools so free memory stays usable. Replayed through a model of the caching allocator,
#   two real training steps of a 25.7M-parameter GPT run out of memory with over 40% of it
#   free without MD, and fit in the same memory with it; on smaller GPTs the pools cost
#   more than they save.
# - Sec 6.1's 100B example: about 33 GB of checkpoints per GPU (the formula's figure at
#   batch 16; at the paper's batch of 32 it gives twice that, near Sec 3.2's about 60 GB)
#   become about 2 GB with $P_a$ at $N_m = 16$.
