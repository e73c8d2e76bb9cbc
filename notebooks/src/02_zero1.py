# %% [markdown]
# # Chapter 2 · ZeRO-1 ($P_{os}$): partition the optimizer states
#
# In data parallelism every rank keeps a full copy of Adam's state, yet each rank could
# update just a slice of the parameters and share the result. ZeRO's first stage does
# exactly that (paper Sec 5.1). This chapter builds it twice: first the way many
# tutorials write it, then the way the package does it, and measures both on real
# gloo ranks.
#
# **Learning goals.** After this chapter you can
#
# 1. state ZeRO-1's model-state memory per rank, $4\Psi + K\Psi/N_d$ bytes in mixed
#    precision (Sec 5.1, Fig 1), and check it against bytes measured on running ranks;
# 2. explain why giving each rank *whole tensors* leaves shards unequal, and how flat
#    buffers padded to a multiple of $N_d$ make them equal (`zerolearn.flat`);
# 3. trace one ZeRO-1 step as reduce-scatter, local update, all-gather, and count its
#    traffic: $2\Psi$ per step, the same as DP (Sec 1, Sec 7);
# 4. measure why the common "all-reduce, then broadcast from each owner" version moves
#    $3\Psi$ instead, while computing exactly the same losses.

# %% [markdown]
# ## 1. The idea in numbers
#
# With mixed-precision Adam a rank holds $2\Psi$ bytes of fp16/bf16 parameters,
# $2\Psi$ of gradients and $K\Psi$ of optimizer state, $K = 12$: an fp32 master copy and
# Adam's two fp32 moments (Sec 3.1). Only the optimizer uses those $12\Psi$ bytes, and
# only to update parameters. If rank $r$ updates just its $1/N_d$ of the parameters, it
# needs just $1/N_d$ of that state (Sec 5.1):
#
# $$\text{DP: } (2 + 2 + K)\,\Psi \qquad\longrightarrow\qquad \text{ZeRO-1: } 4\Psi + \frac{K\Psi}{N_d}.$$
#
# Fig 1's example, $\Psi = 7.5\text{B}$ and $N_d = 64$, goes from 120 GB to 31.4 GB per
# GPU. In pure fp32 there is no separate master copy: parameters and gradients take
# 4 bytes each and Adam's moments $K = 8$, so the same argument gives
# $8\Psi + 8\Psi/N_d$. The formulas live in `zerolearn.memory.model`; every number
# below is compared with them.

# %% [markdown]
# The runs of this chapter use a wider version of the book's GPT: $d_{model} = 128$
# instead of 32, so $\Psi = 464{,}384$. Its tensors range from 128 to 65,536 elements,
# which makes the imbalance of whole-tensor splits visible, and 0.25 MiB buckets cut it
# into 12 groups. The exercises and section 6 keep the book's GPT ($\Psi = 42{,}368$).

# %%
import time

import torch
import torch.distributed as dist

from zerolearn import comm, flat
from zerolearn.chapters.ch02 import lesson as ch02
from zerolearn.chapters.source import excerpt
from zerolearn.config import TrainConfig
from zerolearn.dist import launch
from zerolearn.engines import zero1
from zerolearn.memory import model as analytic
from zerolearn.models import GPTConfig, build_model
from zerolearn.tables import kib, text_table

# %%
D_MODEL, SEQ_LEN, N_LAYER = 128, 16, 2
GPT = TrainConfig(model="gpt", d_model=D_MODEL, seq_len=SEQ_LEN, n_layer=N_LAYER,
                  global_batch_size=12, steps=3, bucket_mb=0.25)  # 12 sequences: divisible by Nd = 2, 3, 4
gpt = build_model("gpt", 0, gpt=GPTConfig(seq_len=SEQ_LEN, n_layer=N_LAYER, d_model=D_MODEL))
sizes = [p.numel() for p in gpt.parameters()]
psi = sum(sizes)
print(f"GPT: Psi = {psi:,} parameters in {len(sizes)} tensors; "
      f"largest tensor {max(sizes):,} elements, smallest {min(sizes):,} elements")

# %% [markdown]
# The view below computes ZeRO-1's bytes per device beside DP's, by category, and what each
# moves per step, from the formulas above. It opens at Fig 1's setting, $\Psi = 7.5\text{B}$,
# $N_d = 64$, $K = 12$. Move **Nd** and only the optimizer states shrink, as $K\Psi/N_d$;
# the traffic stays at DP's $2\Psi$.

# %%
# %matplotlib inline
from IPython.display import display

from zerolearn import widgets
from zerolearn.figures import formulas

display(widgets.StageExplorer(stage=1))  # Fig 1's setting: Psi = 7.5B, Nd = 64, K = 12

# %%
formulas.stage_figure(stage=1)  # the default view, drawn for the book

# %% [markdown]
# ## 2. The version many write: each rank owns whole tensors
#
# The most direct reading of "each rank updates $1/N_d$ of the parameters" is to hand
# out *tensors*: rank 0 takes the first few, rank 1 the next few, and so on. The
# reproduction this book starts from does exactly that: "Understanding ZeRO:
# Memory-Efficient Training from Theory to Practice" by Dipankar Baisya (December 2025),
# which rebuilt ZeRO-1, 2 and 3 in PyTorch on 2 GPUs with a 6-layer MLP of width 10,000.
# We call it *the blog* (see the glossary). It splits the list of tensors into equal
# *counts*. Each rank builds Adam over its own tensors only, so Adam keeps state only for
# them. A smarter whole-tensor split deals the largest tensor first to the emptiest rank.
# Each returns the owning rank of every tensor:

# %%
def owners_by_count(n_tensors, world_size):  # the blog's split: equal numbers of tensors, in order
    per_rank, extra = divmod(n_tensors, world_size)
    return [r for r in range(world_size) for _ in range(per_rank + (r < extra))]

def owners_by_size(sizes, world_size):  # largest tensor first, to the emptiest rank
    load, owners = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i], load[r] = r, load[r] + sizes[i]
    return owners

OWNERS = {"count": lambda sizes, nd: owners_by_count(len(sizes), nd), "size": owners_by_size}

# %% [markdown]
# The naive optimizer around them all-reduces every gradient, steps Adam on the owned
# tensors, then has each owner broadcast its tensors so that every rank again holds the
# same parameters. It is correct; the rest of this chapter measures what it costs.

# %%
class NaiveZero1:
    def __init__(self, model, lr=1e-3, owners="count"):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owners = OWNERS[owners]([p.numel() for p in self.params], self.world_size)
        mine = [p for p, r in zip(self.params, self.owners, strict=True) if r == self.rank]
        self.optimizer = torch.optim.Adam(mine, lr=lr)  # state only for the tensors this rank owns

    @torch.no_grad()
    def step(self):
        for p in self.params:  # every rank gets every averaged gradient: 2 Psi
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        self.optimizer.step()  # updates only the owned tensors
        for p, owner in zip(self.params, self.owners, strict=True):  # each owner sends its new values: Psi
            dist.broadcast(p.data, src=owner)

# %% [markdown]
# Before running anything we can already see the problem in the layout. A rank keeps
# Adam state only for the elements it owns, so the owned elements per rank are its
# optimizer memory in units of 8 bytes (fp32 Adam). With whole tensors these counts
# cannot be equal: tensors come in very different sizes (a LayerNorm bias has 128
# elements, an MLP weight 65,536). The table gives owned elements per rank; the last
# column is the largest rank's share relative to a perfect $\Psi/N_d$.

# %%
def owned_elements(sizes, owners, world_size):  # elements each rank keeps Adam state for
    per_rank = [0] * world_size
    for size, r in zip(sizes, owners, strict=True):
        per_rank[r] += size
    return per_rank

rows = []
for nd in (3, 4):
    for policy in ("count", "size"):
        owned = owned_elements(sizes, OWNERS[policy](sizes, nd), nd)
        rows.append([nd, policy, *owned, *[""] * (4 - nd), f"{max(owned) / (psi / nd):.3f}"])
print(text_table(["Nd", "split by", "rank 0", "rank 1", "rank 2", "rank 3", "largest / (Psi/Nd)"], rows))

# %% [markdown]
# Every rank has to be provisioned for the largest shard, so the imbalance is memory
# lost on every other rank. Splitting by size helps, but no whole-tensor split can give
# its fullest rank less than the largest tensor: once $\Psi/N_d$ drops below it, the imbalance
# grows with $N_d$ (the plot in Section 5 shows it).
#
# ## 3. Flat padded shards
#
# First what ZeRO-1 keeps, drawn from the package's flat buffers for a toy model of Ψ = 26
# parameters over N<sub>d</sub> = 3 ranks: DP above, ZeRO-1 below, a solid slice held, a
# faint one another rank's. Look at the optimizer states: each rank holds one solid third,
# and the last third ends in a hatched padding element.

# %%
from IPython.display import HTML

from zerolearn.figures import schematics

fig = schematics.model_states_figure(nd=3, stages=(0, 1))
fig.suptitle("What a rank keeps: Nd = 3 ranks, 2 + 2 + K bytes per element, K = 12", fontsize=9)
fig

# %% [markdown]
# ZeRO partitions by *element*, not by tensor (Sec 5): lay a group of parameters end to
# end in one 1-D buffer, pad it with zeros to a multiple of the number of shards, and give
# rank $r$ the $r$-th equal slice. Every rank then holds the same number of elements,
# whatever the tensor sizes.
#
# ### Exercise 1 · which elements a rank owns
#
# Write `shard_range(psi, world_size, rank)`: for a flat buffer of `psi` elements split
# over `world_size` ranks, return `(start, end, padding)`, where this rank's shard is
# elements `[start, end)` of the padded buffer and `padding` is the number of zeros
# appended (none when `psi` already divides by `world_size`).
#
# `exercises.check` runs your function on 2 and then 3 real gloo ranks: each rank asks
# for its own shard, the answers are gathered, and the checker looks for elements no rank
# owns, elements two ranks own, shards of unequal size or out of rank order, and more
# padding than needed, for buffers of 1 to 42,368 elements. Your functions may use
# `torch`, `nn`, `F` and `dist` besides their arguments; the next cell imports the ones
# not imported yet, and the checker.

# %%
import torch.nn.functional as F  # noqa: F401 - for the exercises' functions
from torch import nn

from zerolearn import exercises

# %% tags=["exercise"]
# exercise: 02.shard_range

# %%
exercises.check("02.shard_range", shard_range)

# %% [markdown]
# `zerolearn.flat` does this arithmetic for the engines. A `FlatLayout` is only that
# arithmetic, fixed once built (what an engine keeps per bucket from step to step lives in
# `zerolearn.engines.base.Bucket`). Its core is the padding line: round the total up to a
# multiple of the number of shards, and every shard has `padded // num_shards` elements.

# %%
excerpt(flat.FlatLayout.of)

# %% [markdown]
# Parameters keep their shapes as *views* into the buffer, so the model computes as
# before while the optimizer sees one flat tensor. Groups are capped at a bucket size
# (`make_buckets`), which later chapters use to overlap communication with backward
# (Sec 5.2) and to bound temporary buffers (Sec 6.2). Here is a toy group of three
# tensors of 10, 7 and 5 elements on $N_d = 3$ ranks: 22 elements padded to 24, so each
# rank's shard has 8 elements, and shards cut straight through tensors.

# %%
toy = [(name, nn.Parameter(torch.zeros(n))) for name, n in (("a", 10), ("b", 7), ("c", 5))]
for rank in range(3):
    g = flat.make_buckets(toy, bucket_bytes=1 << 20, element_size=4, num_shards=3, shard_index=rank)[0]
    print(f"rank {rank}: shard = elements [{g.shard_range[0]:>2}, {g.shard_range[1]:>2}) "
          f"of {g.padded_numel} ({g.numel} real + {g.padding} padding); tensor offsets {g.offsets}")

# %% [markdown]
# ### Exercise 2 · the flat buffer
#
# Build this layout yourself, for a whole model. Write `flatten_params(model, world_size)`: lay
# the parameters end to end in one new 1-D buffer `flat`, padded with zeros to a multiple of
# `world_size`, copy each parameter's values into its slice, and then make the parameter
# *itself* a view of that slice by assigning its `.data`: the module computes as before, and
# a step written into `flat` is a step of the module. Give `flat` a twin, `flat_grad`, and
# make each parameter's `.grad` a zeroed view of its slice there: autograd adds a new
# gradient into an existing `.grad` in place, so after `loss.backward()` the whole gradient
# lies in one buffer, ready for one collective. Return `(flat, flat_grad)`.
#
# The checker gives each rank the book's GPT on 2 and then 3 ranks and looks at what you left:
# the padded length, each parameter still the module's own, with its values, at its offset in
# `flat`'s storage, its gradient in `flat_grad`'s, zeros in both paddings. Then it trains three
# SGD steps through your buffers alone (backward, one `dist.all_reduce` of `flat_grad`, an
# update of `flat`) and compares the module's parameters with one process.

# %% tags=["exercise"]
# exercise: 02.flatten_params

# %%
exercises.check("02.flatten_params", flatten_params)

# %% [markdown]
# ## 4. Reduce-scatter, update, all-gather
#
# First the whole step, on seven numbers over three ranks (padded to nine, so each shard
# has three), with SGD at learning rate 1. A colour marks the rank that owns a slice; the
# hatched slots are padding. Step through the four frames and follow rank 1's orange
# shard: the only part of the reduced gradient rank 1 reads, and the only part it updates. At
# ZeRO-1 rank 1 still keeps its whole gradient buffer (grey: kept, not read by the step).

# %%
step = schematics.zero1_animation(nd=3)  # in JupyterLab, step.widget(): play button and slider
HTML(step.html)

# %% [markdown]
# With equal flat shards the ZeRO-1 step is three moves (Sec 5.1; the schedule is ours):
#
# 1. **reduce-scatter** the gradient buffer: rank $r$ receives the sum over ranks of
#    slice $r$ only, exactly the slice it updates ($\Psi$ elements in the paper's count);
# 2. **update** the shard: Adam over the fp32 master shard and its moments, $K\Psi/N_d$ bytes;
# 3. **all-gather** the updated shards into every rank's full parameter buffer
#    ($\Psi$ more).
#
# A ring all-reduce *is* a reduce-scatter followed by an all-gather (Sec 7.1), so ZeRO-1
# moves the $2\Psi$ that DP moves, and simply does the update in between.
#
# ### 4.1 The three moves, one cell at a time, on live ranks
#
# `%%ranks 3` (from `zerolearn.live`) runs a cell on 3 real gloo ranks that keep their
# variables from one cell to the next; each starts with `rank`, `world_size`, `torch` and
# `dist`, and every line a rank prints is labelled with its rank. Each rank
# builds its own "gradient" of $\Psi = 7$ elements, which 3 ranks cannot split evenly, so
# the flat buffer is padded to 9:

# %% tags=["live"]
# %load_ext zerolearn.live

# %% tags=["live"]
# %%ranks 3
psi, shard = 7, 3  # ceil(7 / 3) elements per rank
grad = torch.zeros(shard * world_size)  # the flat buffer, padded to 9
grad[:psi] = (rank + 1) * torch.arange(1.0, psi + 1)
print(grad.tolist())

# %% [markdown]
# Reduce-scatter: rank $r$ receives the sum over ranks of slice $r$ only. The sum is
# $6\cdot[1, \dots, 7]$; rank 2's slice is one real element and the two of padding.

# %% tags=["live"]
# %%ranks
mine = torch.empty(shard)
dist.reduce_scatter_single(mine, grad)  # (output, input)
print(mine.tolist())

# %% [markdown]
# Each rank updates its own slice (here: subtract 0.5), then all-gather puts every
# updated slice on every rank; the first 7 values are the parameters, the rest padding.

# %% tags=["live"]
# %%ranks
mine -= 0.5
full = torch.empty(shard * world_size)
dist.all_gather_single(full, mine)  # (output, input)
print(full[:psi].tolist())

# %% tags=["live"]
# %ranks stop

# %% [markdown]
# ### Exercise 3 · one ZeRO-1 step
#
# Now the same three moves on a real model, with Adam instead of "subtract 0.5". Write
# `zero1_step(flat_params, flat_grad, state, world_size, rank, lr)`, the step on one flat
# buffer of `n` elements (a multiple of `world_size`), after backward, in mixed precision
# as Sec 3.1 describes it:
#
# - `flat_params` holds the working parameters, fp32 or bf16, end to end, then zeros; the
#   model's parameters are views into it, so it must hold the updated parameters, in its
#   own dtype, on return;
# - `flat_grad` is this rank's gradient laid out the same way, in the same dtype;
# - `state` is a dict kept from step to step (empty at the first step): keep in it an
#   **fp32** master copy of this rank's shard and a `torch.optim.Adam(..., lr=lr)` over
#   that master alone. Adam steps the master, never the bf16 parameters: an update smaller
#   than a bf16 parameter's last bit would be lost.

# %% [markdown]
# Reduce-scatter `flat_grad` into this rank's shard and average it in fp32, step Adam on
# the master, cast the master to the working dtype and all-gather it into `flat_params`,
# and return the fp32 averaged gradient shard you stepped with. Use
# `dist.reduce_scatter_single(output, input)` and `dist.all_gather_single(output, input)`. Two keywords,
# `reduced` and `gather`, let chapters 3 and 4 call the same step on a gradient already
# reduced and on a parameter shard alone; the stub's docstring says what they do.
#
# The checker trains the book's GPT (Ψ = 42,368, so 3 ranks need one padding element) on
# 2 and then 3 ranks: three fp32 steps against single-process Adam on the whole batch
# (the gradient shard you return and every parameter), one step each as chapters 3 and 4
# call it, then three bf16 steps, where your fp32 master must equal fp32 Adam stepped with
# your gradient. It also reads the ledger (ZeRO-1 moves 2 Ψ per step) and the tensors you
# keep in `state`: at most $K\Psi/N_d$ bytes, $K = 12$ (a 4-byte master and Adam's two
# 4-byte moments per shard element), in fp32 as in bf16.

# %% tags=["exercise"]
# exercise: 02.zero1_step

# %%
exercises.check("02.zero1_step", zero1_step)

# %% [markdown]
# The package's engine does the same for each flat group (a bucket). It is short because the
# shared base class (`engines/base.py`) launches a bucket's reduction from autograd hooks as
# soon as its gradients are complete; the stage says only what it keeps, how it reduces and
# how it publishes. Its two collectives are your exercise's: a reduce-scatter into a shard
# during backward, and after the step an all-gather that runs in place, every rank's slice
# landing around this rank's updated one:

# %%
excerpt(zero1.Zero1Engine, ("def _reduce", "return comm.reduce_scatter"), ("def _publish", "self._publishing"))

# %% [markdown]
# ## 5. Running it on real ranks
#
# One cell runs every experiment of this chapter, since starting ranks costs seconds:
# for $N_d = 2, 3, 4$ the package's ZeRO-1 engine (`train`, stage 1, fp32 and bf16,
# 3 steps), and for $N_d = 3, 4$ the naive version with both splits, on the same model,
# seed and global batches. The `NaiveZero1` above travels to the ranks by value, its code with it.

# %% tags=["nbval-ignore-output"]
def specs(nd):
    jobs = [("train", GPT.replace(stage=1, dtype=dtype)) for dtype in ("fp32", "bf16")]
    if nd > 2:
        jobs += [("naive", NaiveZero1, GPT, {"owners": policy}) for policy in ("count", "size")]
    return jobs

t0 = time.perf_counter()
results = {nd: launch(ch02.jobs, nd, specs(nd)) for nd in (2, 3, 4)}  # results[nd][rank][job]
print(f"{sum((2, 3, 4))} ranks in 3 launches: {time.perf_counter() - t0:.0f} s")

# %% [markdown]
# ### 5.1 Optimizer memory per rank: whole tensors against flat shards
#
# The naive runs report the bytes of Adam state each rank really holds (the tensors in
# its `optimizer.state`); the engine's report measures its tensors the same way. Both train
# in fp32, so Adam keeps 8 bytes per element it updates.

# %%
rows = []
for nd in (3, 4):
    for rank, (eng, _, by_count, by_size) in enumerate(r[:4] for r in results[nd]):
        mine = eng["ranks"][rank]["model_state_bytes"]["optimizer_states"]
        rows.append([nd, rank, *(kib(n) for n in (by_count["optimizer_state_bytes"],
                                                  by_size["optimizer_state_bytes"], mine, 8 * psi / nd))])
print(text_table(["Nd", "rank", "whole tensors,\nby count", "whole tensors,\nby size", "flat shards\n(engine)",
                  "perfect split\n8 Psi / Nd"], rows))
print("KiB of Adam state per rank")

# %% [markdown]
# The flat shards are equal to the byte on every rank, and exceed $8\Psi/N_d$ only by
# the padding (a few elements per group). Whole tensors leave one rank with far more
# than its share when split by count, and even the size-aware split cannot go below the
# largest tensor. The plot extends the comparison to larger $N_d$ (computed from the
# layout, as in Section 2; the crosses are the measured runs above).

# %%
nds = list(range(1, 17))
bucket = int(0.25 * 2**20)  # the train CLI's default --bucket-mb 0.25
named = list(gpt.named_parameters())[::-1]  # the engines lay parameters out in reverse order

def fullest(owners, n):  # the fullest rank's elements, over a perfect Psi / Nd
    return max(owned_elements(sizes, owners, n)) / (psi / n)

curves = {
    "whole tensors, by count (the blog's split)": [fullest(owners_by_count(len(sizes), n), n) for n in nds],
    "whole tensors, by size (largest first)": [fullest(owners_by_size(sizes, n), n) for n in nds],
    "flat padded shards (zerolearn.flat)":  # every rank's shards hold the same number of elements
        [sum(g.shard_numel for g in flat.make_buckets(named, bucket, 4, n, 0)) / (psi / n) for n in nds],
}
ch02.imbalance_figure(nds, curves, results, psi, largest_tensor=max(sizes))

# %% [markdown]
# ### 5.2 Bytes per rank against $4\Psi + K\Psi/N_d$
#
# Now the whole of the model states. For each run the report holds, per rank, the
# bytes of parameters, gradients (as held after backward) and optimizer states measured
# from the tensors (first table), and the paper's formula for the same run (`analytic`,
# from `zerolearn.memory.model`, which uses the unpadded $\Psi$). The second table
# explains the difference: the flat buffers hold $\Psi + \text{padding}$ elements, so
# measured minus formula must equal padding $\times$ (param bytes + grad bytes + $K/N_d$).

# %%
reports = [results[nd][0][job] for nd in (2, 3, 4) for job in (0, 1)]  # fp32 and bf16, rank 0's copy
for rep in reports:  # every rank holds the same bytes
    assert all(r["model_state_bytes"] == rep["ranks"][0]["model_state_bytes"] for r in rep["ranks"])
held, padding = ch02.bytes_tables(reports)
print(held)
print()
print(padding)

# %% [markdown]
# Measured equals the formula once padding is counted (second table), on every rank (the
# `assert` checks that all ranks hold the same bytes). In bf16 the optimizer column is the
# largest even at $N_d = 4$: $K = 12$ bytes per parameter against 2 + 2 for the
# working copies, which is why partitioning it first pays most. The plot shows the
# same numbers per parameter: the formula approaches $4\Psi$ (bf16) or $8\Psi$ (fp32) as
# $N_d$ grows, never lower, because ZeRO-1 still replicates parameters and gradients.
# Those are the next two chapters.

# %%
rows = [(rep["world_size"], rep["config"]["dtype"], sum(rep["ranks"][0]["model_state_bytes"].values()))
        for rep in reports]  # (Nd, dtype, bytes held)
ch02.bytes_figure(rows, psi)

# %% [markdown]
# ### 5.3 Traffic: $2\Psi$ against $3\Psi$
#
# The engine's collectives go through `zerolearn.comm`, and the naive version's
# `dist.all_reduce` and `dist.broadcast` are watched (`zerolearn.watch`): one ledger counts the
# elements of each call: the input of a reduce-scatter, the output of an all-gather, the tensor of
# an all-reduce or broadcast. In that count the paper's per-rank volume (Sec 7.1) is
# $2\cdot$all-reduce + reduce-scatter + all-gather + broadcast, since an all-reduce moves
# its tensor twice (a reduce-scatter and an all-gather). The paper, as here, leaves out
# the ring's factor $(N_d - 1)/N_d$.

# %%
runs = []
for nd in (3, 4):
    eng, _, by_count, _ = results[nd][0][:4]
    runs += [(f"Nd {nd}, engine (RS + AG)", eng["ranks"][0]["comm"]),
             (f"Nd {nd}, naive (AR + bcast)", by_count["comm"])]
print(ch02.traffic_table(runs, psi, steps=3))
print(f"elements per step; Psi = {psi:,}; paper (Sec 1, Sec 7): ZeRO-1 moves "
      f"{analytic.comm_volume_elements(1, 1)} Psi per step, like DP")

# %% [markdown]
# The engine moves $2\Psi$ (plus the few padding elements) with one reduce-scatter and
# one all-gather per flat group (12 groups of at most 0.25 MiB here). The naive version moves $3\Psi$:
# its all-reduce already delivers every averaged gradient to every rank, $2\Psi$, and
# then the broadcasts send all parameters again. It also makes two calls per tensor,
# which on a real network adds a latency per call. The extra $\Psi$ buys nothing: each
# rank used only the gradients of the tensors it owns.

# %% [markdown]
# The paper counts no schedule for ZeRO-1 alone. It gives $P_{os}$ DP's volume (Sec 1,
# and Sec 7: no additional communication with $P_{os}$ and $P_g$) and ends its step
# with an all-gather of the updated parameters (Sec 5.1). The count it writes out, a
# reduce-scatter of the gradients, $\Psi$, then that all-gather, $\Psi$, is for
# gradient partitioning, $P_{os+g}$ (Sec 7.2.1, chapter 3).
# Our ZeRO-1 runs the same two collectives: the schedule is the book's. DeepSpeed's
# first stage 1 all-reduced the gradients instead; its news of 17 March 2020 reports
# the partition-aware version cutting the volume from 1.5x to 1x DP's: the naive
# $3\Psi$ and the engine's $2\Psi$ above.
#
# Elsewhere the paper words the moves per partition: gradients *reduced* to the rank
# that owns them (Sec 5.2), parameters *broadcast* by their owner (Sec 5.3, 7.2.2). Done
# for all $N_d$ partitions at once, those reduces are one reduce-scatter and those
# broadcasts one all-gather: the same data reaches the same ranks. Per rank each sends and
# receives $\Psi (N_d - 1)/N_d$ elements, so about $2\Psi$ in all, the engine's measured
# volume above. A ring all-reduce is this same pair (Sec 7.1), which is why $P_{os}$
# moves no more than DP.

# %% [markdown]
# ### 5.4 Same arithmetic, same losses
#
# Both versions apply the same Adam update to the same averaged gradients, so the
# losses must agree, step by step, to rounding (the engine averages before summing,
# the naive version after). bf16 computes in a different precision, so its losses
# differ slightly. Losses are printed to the digits that are information: fp32 to 5
# significant digits, bf16 to 3 (7 stored fraction bits, 8 bits of precision with the
# implicit one; further digits change with the CPU).

# %%
rows, gap = [], 0.0
for nd in (3, 4):
    eng, eng16, by_count, by_size = results[nd][0][:4]
    for step in range(3):
        rows.append([nd, step, *(f"{run['losses'][step]:.4f}" for run in (eng, by_count, by_size)),
                     f"{eng16['losses'][step]:#.3g}"])
    gap = max([gap] + [abs(a - b) for run in (by_count, by_size)
                       for a, b in zip(eng["losses"], run["losses"], strict=True)])
print(text_table(["Nd", "step", "engine fp32", "naive by count", "naive by size", "engine bf16"], rows))
print(f"fp32 engine and naive agree within 1e-5: {gap < 1e-5}")

# %% [markdown]
# ### 5.5 The same step on a timeline
#
# ZeRO-1 launches a reduce-scatter from the same backward hooks where DP all-reduced, and
# publishes each group's updated shard with an all-gather that can run while the next group's
# shard is updated (recorded as in chapter 1, `zerolearn.timeline`, the same GPT on 2 ranks).
# The order of the calls and the phase each runs in carry over to GPUs, the times do not
# ([appendix: what two CPU cores cannot show](../book/cpu_timelines.md)):

# %%
from zerolearn import figures
from zerolearn.chapters import stored

TL = stored("timeline/stages.json")
for st in TL["stages"][:2]:
    ops = [op for op, c in st["ledger"][0].items() if c["calls"]]
    print(f"stage {st['stage']}: " + "; ".join(
        f"{st['ledger'][0][op]['calls']} {op}, launched in "
        + " and ".join(sorted({i['phase'] for i in st['intervals'] if i['lane'] == 'comm' and i['label'] == op}))
        for op in ops))

# %%
figures.stage_timelines_figure(TL, stages=(0, 1))

# %% tags=["nbval-ignore-output"]
for r in TL["stages"][1]["summary"]:
    b, s = r["phases"]["backward"], r["phases"]["step"]
    print(f"rank {r['rank']}: reduce-scatters {b['overlap']:.0%} hidden behind backward, "
          f"all-gathers {s['overlap']:.0%} hidden behind the optimizer step; blocked {r['wait_s'] * 1e3:.1f} ms")

# %% [markdown]
# ## 6. Your engine trains
#
# Your two functions are the whole of a ZeRO-1 engine. `zerolearn/nano.py` (under 300
# lines, read top to bottom) assembles the four stages from the book's exercises;
# at stage 1 it lays the parameters out in one flat buffer with your `shard_range`, and
# its step is your `zero1_step`:

# %%
from zerolearn.chapters.your_engine import your_engine
from zerolearn.nano import Flat, NanoZero

excerpt(Flat, ("self.start, self.end", "self.full = torch.zeros"))

# %%
excerpt(NanoZero.step, ("elif self.stage == 1:", "args, kwargs ="), ("self.fn[\"zero1_step\"]", "zero1_step"))

# %% [markdown]
# The next cell trains the exercises' GPT (Ψ = 42,368) for four steps on 2 ranks with your
# parts, beside one process on the whole batch and beside the package's `Zero1Engine`. Look
# at three columns: your losses must equal one process's; a rank holds Fig 1's formula with
# fp32's 4-byte parameters and gradients, $(4 + 4 + K/N_d)\Psi$ bytes, $K = 12$ since your
# step keeps an fp32 master; and the traffic is $2\Psi$ per step (Sec 1, Sec 7).

# %%
your_engine(1, {"shard_range": shard_range, "zero1_step": zero1_step})

# %% [markdown]
# What the package's engine adds to these few lines:
#
# | the package's engine adds | why | where |
# |---|---|---|
# | buckets of a fixed size, reduced from hooks | overlap with backward; bounded buffers | ch. 1, ch. 3 §2 |
# | the all-gather in place, asynchronous | no copy; overlaps the next bucket's update | §4, §5.5 above |
# | in fp32, the master *is* the rank's slice | $K = 8$, not 12: no separate copy | §1, §5.2 above |
# | fp16 with a loss scale; gradient clipping | fp16 underflow; a norm over all shards | `engines/base.py` |
# | gradient accumulation (`no_sync`) | larger batches in the same memory | ch. 3 §6 |
# | optimizer state and step on the CPU | the $K\Psi/N_d$ bytes leave the GPU | ch. 8 §1 |

# %% [markdown]
# ## Questions
#
# Write your answer down before running the cell after each question.
#
# 1. The book's GPT has $\Psi = 42{,}368$ parameters. Split into flat shards over
#    $N_d = 5$ ranks, how many padding elements does its buffer need, and how many
#    elements does each shard hold?

# %%
layout = flat.FlatLayout.of(["all"], [torch.Size([42_368])], num_shards=5, shard_index=0)
print(f"padding {layout.padding} elements; each of 5 shards holds {layout.shard_numel:,} elements")

# %% [markdown]
# 2. In mixed precision ($K = 12$), how many bytes of model states per parameter does a
#    ZeRO-1 rank hold at $N_d = 8$? And at $N_d = 64$?

# %%
for nd in (8, 64):
    print(f"Nd = {nd}: {analytic.model_state_bytes(1, nd, 1, k=12)['total']:.4g} bytes per parameter")

# %% [markdown]
# 3. The naive ZeRO-1 at $N_d = 4$ in section 5: how many $\Psi$ per step did it move, and
#    how many of them were all-reduce traffic?

# %%
naive = results[4][0][2]["comm"]  # rank 0, the naive run split by count
print(f"all-reduce {2 * naive['all_reduce']['elements'] / 3 / psi:.3f} Psi, broadcast "
      f"{naive['broadcast']['elements'] / 3 / psi:.3f} Psi per step")

# %% [markdown]
# 4. With the blog's split by count at $N_d = 4$, how many KiB of Adam state does the
#    fullest rank hold, against the 8 Ψ / 4 of a perfect split? (Section 2's table gives
#    its elements.)

# %%
fullest_rank = max(r[2]["optimizer_state_bytes"] for r in results[4])
print(f"fullest rank {kib(fullest_rank, unit=True)}; perfect split {kib(8 * psi / 4, unit=True)}")

# %% [markdown]
# ## Summary
#
# - ZeRO-1 keeps full parameters and gradients but only $1/N_d$ of the optimizer state:
#   $4\Psi + K\Psi/N_d$ bytes per rank in mixed precision (Sec 5.1, Fig 1). Measured
#   bytes on 2, 3 and 4 gloo ranks equal the formula once padding is counted.
# - Sharding by whole tensor leaves ranks unequal, and no whole-tensor split gives
#   its fullest rank less than the largest tensor. Flat buffers padded to a multiple of $N_d$ give equal
#   shards at the cost of fewer than $N_d$ zeros per group.
# - A step is reduce-scatter, local update, all-gather: $2\Psi$ per step, DP's volume
#   (Sec 1, Sec 7). All-reduce plus broadcast computes the same losses but moves $3\Psi$.
# - Parameters and gradients are still replicated: $4\Psi$ is ZeRO-1's floor. The
#   next chapter partitions the gradients.
