# %% [markdown]
# # Chapter 4 · ZeRO-3 ($P_{os+g+p}$): partition the parameters too
#
# After ZeRO-2 a rank still keeps one thing in full: the working parameters, 2 bytes
# per parameter in mixed precision. At Psi = 7.5B and Nd = 64 that replica is 15 of the
# 16.6 GB a ZeRO-2 rank holds (Fig 1). ZeRO-3 partitions the parameters too, so every
# model state is divided by Nd: (2 + 2 + K) Psi / Nd bytes per rank (Sec 5.3). The
# price is communication: a rank must fetch the parameters it does not own each time
# it needs them, once in forward and once in backward, which raises the traffic from
# 2 Psi to 3 Psi per step (Sec 7.2.2).

# %% [markdown]
# **Learning goals.** After this chapter you can
#
# 1. explain how ZeRO-3 gathers each parameter just before its use in forward and in
#    backward and frees it after, the gathers pipelined with the passes (Sec 7.2.2), and
#    write the hooks that do it on *units*, with the next unit prefetched, checked on
#    real ranks;
# 2. free a gathered tensor so that its memory is really released, and show with the
#    memory ledger why reassigning `.data` does not do it;
# 3. read ZeRO-3's sawtooth in a measured memory timeline and bound its peak by the
#    shards plus two gathered units;
# 4. measure 3 Psi of traffic per step against DP's 2 Psi;
# 5. measure per-rank memory at Nd = 8, 64 and 1024 and compare it with the formula
#    and with the trend of Table 1.

# %%
# %matplotlib inline
from zerolearn import figures
from zerolearn.chapters.ch04 import lesson as ch04
from zerolearn.chapters.source import excerpt
from zerolearn.config import TrainConfig
from zerolearn.dist import launch
from zerolearn.engines.zero3 import Zero3Engine
from zerolearn.exercises.helpers import GPT
from zerolearn.memory.model import STAGE_NAMES, TABLE1_GB, comm_volume_elements, model_state_bytes
from zerolearn.models import build_model
from zerolearn.report import volume_per_step
from zerolearn.tables import text_table

# %% [markdown]
# ## 1. Units: what is gathered together
#
# The paper's piece is a partition, owned whole by one rank: just before forward reaches
# the part of the model it holds, its owner broadcasts it to every rank, which discard
# it once that part has run; backward repeats this in reverse (Sec 5.3, Sec 7.2.2).
# Later implementations shard every piece over all ranks and all-gather it (ZeRO-Infinity,
# its Sec 6.1, DeepSpeed, PyTorch's FSDP, this package): Psi per pass either way, but an
# owner's broadcast keeps only its own link busy, while an all-gather uses every rank's.
# Their pieces are *units*, groups of modules that run together. One parameter at a time
# would pay a collective's fixed cost for each of hundreds of tensors; the whole model at
# once would hold the whole replica again, if only for a moment. The book's GPT of the
# exercises (Psi = 42,368) has four units: the embedding, each of its two blocks and the
# head (`GPT.units()`). The engine lays each unit's parameters into its own flat buffers,
# sharded over all ranks, so a unit is gathered with one all-gather per buffer; in bf16 a
# parameter takes 2 bytes.

# %%
BOOK = dict(model="gpt", n_layer=GPT.n_layer, d_model=GPT.d_model, n_head=GPT.n_head, seq_len=GPT.seq_len)
model = build_model('gpt', 0, gpt=GPT)
psi = sum(p.numel() for p in model.parameters())
units = [(type(u).__name__, sum(p.numel() for p in u.parameters())) for u in model.units()]
print(text_table(['unit', 'parameters', 'bf16 bytes'], [[n, c, 2 * c] for n, c in units]))
print(f'Psi = {psi:,} parameters; a block has 12 h^2 + 13 h = {12 * 32**2 + 13 * 32:,} of them (h = 32)')
# %% [markdown]
# Between uses, a rank of an Nd-rank job keeps only its 1/Nd shard of every unit. The
# engine's `_init_bucket` keeps the shard, builds the full buffer once so that each
# parameter becomes a *view* of it, and then frees that buffer's memory at once:

# %%
excerpt(Zero3Engine._init_bucket, ("def _init_bucket", "b.shard = "), ("b.full = full", "b.layout.bind"),
        ("b.full.untyped_storage().resize_(0)", "b.full.untyped_storage().resize_(0)"))

# %% [markdown]
# For ZeRO-3 every row of the table is divided by $N_d$. The right panel shows the price:
# $3\Psi$ per step instead of $2\Psi$ (Sec 7.2.2).

# %%
# %matplotlib inline
from IPython.display import display

from zerolearn import widgets
from zerolearn.figures import formulas

display(widgets.StageExplorer(stage=3))  # Fig 1's setting: Psi = 7.5B, Nd = 64, K = 12

# %%
formulas.stage_figure(stage=3)  # the default view, drawn for the book

# %% [markdown]
# ## 2. Freeing memory for real
#
# `_free` does not delete the buffer, and it does not point the parameters somewhere
# else; it resizes the buffer's *storage* to 0 bytes. The reason is autograd. When a
# unit runs forward, autograd saves what backward will need, and for a linear layer
# that includes the weight, as a view of the same storage. Any tensor that shares the
# storage keeps all of its bytes alive. So the common way of "freeing" a gathered
# parameter, reassigning `param.data` to an empty tensor and dropping the buffer,
# frees nothing while a graph exists: the saved view still holds the storage.
#
# Here is that pitfall, measured. A `Linear(256, 256)` has a weight of 256 x 256 fp32
# values, 262,144 bytes, laid into a flat buffer as ZeRO-3 lays a gathered unit. The
# `MemoryLedger` (`zerolearn.memory.ledger`) follows every storage that is allocated,
# freed or resized while it is active, and reports the live bytes per category.

# %%
import torch

from zerolearn.memory.ledger import MemoryLedger, category

WIDTH = 256


def gathered_linear(width=WIDTH):
    """A Linear(width, width) whose weight is a view of a flat buffer, as ZeRO-3 lays out a gathered unit."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(width, width, bias=False)
    with category("params"):  # the unit's flat buffer, "all-gathered" into here
        full = torch.zeros(width * width)
    full.copy_(layer.weight.detach().flatten())
    layer.weight.data = full.view(width, width)
    return layer, full


# %% [markdown]
# First the common way, while the graph of a forward is alive:

# %%
with MemoryLedger() as ledger:
    layer, full = gathered_linear()
    seen = {"gathered": ledger.live["params"]}
    y = layer(torch.randn(4, WIDTH, requires_grad=True))  # autograd saves a view of the weight
    seen["after forward"] = ledger.live["params"]
    layer.weight.data = torch.empty(0)  # "free" the unit...
    del full  # ...and drop our own reference to its buffer
    seen["after 'free'"] = ledger.live["params"]
    del y  # only releasing the graph lets the storage go
    seen["after the graph is released"] = ledger.live["params"]
for moment, nbytes in seen.items():
    print(f'{moment:>30}: {nbytes:>9,} bytes of parameters live')

# %% [markdown]
# The bytes stay until the graph is released, which in training is the end of
# backward: exactly when freeing them no longer helps. (The parameter is also empty
# now, so backward would fail besides.)
#
# Resizing the storage frees the bytes while every view keeps pointing at the same,
# now empty, storage. Before backward the engine grows the storage back and
# all-gathers into it; the views autograd saved then read the gathered values, and
# backward runs on the same graph:

# %%
x = torch.ones(4, WIDTH, requires_grad=True)
with MemoryLedger() as ledger:
    layer, full = gathered_linear()
    y = layer(x)
    seen = {"after forward": ledger.live["params"]}
    values = full.clone()  # stands for the shards the next all_gather brings back
    full.untyped_storage().resize_(0)  # free: the storage now holds 0 bytes
    seen["after free"] = ledger.live["params"]
    full.untyped_storage().resize_(full.numel() * full.element_size())
    full.copy_(values)  # "gathered again" before backward
    seen["gathered again"] = ledger.live["params"]
    y.sum().backward()
for moment, nbytes in seen.items():
    print(f'{moment:>16}: {nbytes:>9,} bytes of parameters live')
print(f'{"x_grad_sum":>16}: {x.grad.sum().item():>9.4g}')


# %% [markdown]
# The input was all ones, so the gradient of `y.sum()` with respect to each input
# element is a column sum of the weight, and `x_grad_sum` (4 rows of those sums) is a
# real number computed from the re-filled values.
#
# ## 3. Gather and free around forward and backward, with prefetch
#
# First the schedule itself, recorded from a real `Zero3Engine` training the book's GPT
# on one rank, so that it runs in this process. Each lane is a unit; the marks are the
# engine's gathers, prefetches (gathers started early, for the next unit; section 3
# explains them), computes and frees in the order they happened, forward
# then backward (hatched). Below them, the bytes of full parameters alive (fp32 here, 4
# bytes each). Step through it and watch the lower panel: above the shards it never
# holds more than two gathered units (the one computing and the one prefetched), and
# nothing at the end of forward and of backward.

# %%
from IPython.display import HTML

from zerolearn.figures import schematics

tokens = torch.randint(0, GPT.vocab_size, (4, GPT.seq_len), generator=torch.Generator().manual_seed(0))
schedule = schematics.zero3_schedule(build_model('gpt', 0, gpt=GPT), tokens)  # one rank: a gather is a copy
player = schematics.zero3_animation(schedule)  # in JupyterLab, player.widget(): play button and slider
HTML(player.html)

# %% [markdown]
# That is the sawtooth section 6 measures on two ranks. The order comes from module
# hooks:
#
# * **forward**: a forward *pre*-hook gathers the unit and starts the all-gather of the
#   next unit (prefetch), so the next unit's data is on its way while this one
#   computes; a forward hook frees the unit again and registers a hook on its output;
# * **backward**: that output hook fires when the output's gradient is ready, i.e.
#   just before autograd enters the unit's backward; it gathers the unit again and
#   prefetches the *previous* unit, the next one backward will reach;
# * once all of a unit's gradients have arrived in their buckets, the unit is freed.
#
# So, between units, a rank holds its shards; during a unit's compute, that unit plus
# at most one prefetched neighbour: about two gathered units. Units, hooks and prefetch
# are not in the paper: they are how this package, like DeepSpeed and FSDP, pipelines
# the all-gathers with the passes as Sec 7.2.2 asks.

# %% [markdown]
# ### 3.1 Gather, use, free, on live ranks
#
# `%%ranks 2` (from `zerolearn.live`, as in chapter 2) runs a cell on 2 real gloo ranks
# that keep their variables from one cell to the next; each starts with `rank`,
# `world_size`, `torch`, `dist` and `comm`. Each rank builds the same one-unit model, a
# `Linear(4, 3)` whose 12 weights are a view of a flat buffer, keeps its own 6 of them,
# and frees the buffer:

# %% tags=["live"]
# %load_ext zerolearn.live

# %% tags=["live"]
# %%ranks 2
layer = torch.nn.Linear(4, 3, bias=False)  # the unit: 12 parameters
full = torch.zeros(12)  # its flat buffer, 2 ranks x 6
layer.weight.data = full.view(3, 4)  # the weight is a view of the buffer
shard = torch.arange(6.0) + 6 * rank  # this rank's 6 values: the only copy it keeps
full.untyped_storage().resize_(0)  # between uses: 0 bytes
print(f"shard {shard.tolist()}, buffer {full.untyped_storage().nbytes()} bytes")

# %% [markdown]
# Before the unit's forward, grow the storage back and all-gather the shards into it;
# after the forward, free it again. With an input of ones, each output is the sum of a
# row of the gathered weight: 0 + 1 + 2 + 3 = 6, then 22 and 38.

# %% tags=["live"]
# %%ranks
full.untyped_storage().resize_(full.numel() * 4)  # gather: 48 bytes again...
dist.all_gather_single(full, shard)  # ...filled with both shards, in rank order
y = layer(torch.ones(1, 4))  # forward: each output sums a row of the weight
full.untyped_storage().resize_(0)  # free right after use
print(f"y = {y.tolist()}, buffer {full.untyped_storage().nbytes()} bytes")

# %% tags=["live"]
# %ranks stop

# %% [markdown]
# ### 3.2 Your hooks
#
# Before reading the engine's hooks, write them. Each exercise below is a function with
# a stated signature; `exercises.check` runs it on 2 and then 3 real gloo ranks (3 ranks
# make uneven shards, so every unit is padded) and compares it with single-process
# training and with the memory and communication ledgers. Besides their arguments,
# exercise functions may use the names the next cell imports.

# %%
import torch  # noqa: F401 - for the exercises' functions
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from torch import nn  # noqa: F401

from zerolearn import comm, exercises  # noqa: F401

# %% [markdown]
# ### Exercise 1 · gather and free around a unit
#
# Write `gather_hooks(unit, flat, shard, world_size)`. The unit's parameters are views
# of `flat` (fp32, 1-D, `world_size * shard.numel()` elements, zero-padded), whose
# storage holds 0 bytes between uses; `shard` (fp32, 1-D) is the rank's slice of it, the
# only copy of the parameters it keeps. To gather, grow the storage back,
# `flat.untyped_storage().resize_(flat.numel() * 4)`, and `dist.all_gather_single(flat, shard)`
# into it; to free, resize it to 0 bytes, as Section 3.1 did. Register hooks on the unit
# so that it is gathered for its forward and again for its backward, and freed after
# each. The checker cuts the seed MLP (4 Linear layers of width 64) into one unit per
# layer, trains 3 SGD steps and compares the gradients with one process; it reads the
# parameter bytes alive over the step from the memory ledger (at most the shards plus
# one unit or two) and counts the elements gathered per step (2 $\Psi$; 3 $\Psi$ with
# the gradients' reduce-scatter, Sec 7.2.2).

# %% tags=["exercise"]
# exercise: 04.gather_hooks

# %%
exercises.check("04.gather_hooks", gather_hooks)

# %% [markdown]
# ### Exercise 2 · prefetch
#
# Gathering a unit only when it is needed makes every unit wait for its own all-gather.
# Write `prefetch(units, flats, shards, world_size)`: `units` in forward order, `flats[i]`
# and `shards[i]` as in Exercise 1 for `units[i]`. In each unit's forward pre-hook, make
# sure the unit is gathered, then launch the next unit's all-gather without waiting for
# it, `dist.all_gather_single(..., async_op=True)`, which returns a handle whose `.wait()`
# blocks until the data has arrived; free each unit in its forward hook. Backward runs
# the units in reverse: in the output's hook, make sure the unit is gathered and launch
# the *previous* unit's all-gather; free a unit once all its gradients have arrived, as in
# Exercise 1. The checker runs evaluation passes (under `torch.no_grad()`, no backward)
# and training steps, and logs every launch, wait and compute: while unit $i$ computes,
# the all-gather of the unit that comes next must be in flight, and the outputs and
# gradients must equal one process.

# %% tags=["exercise"]
# exercise: 04.prefetch

# %%
exercises.check("04.prefetch", prefetch)

# %% [markdown]
# The engine does both for units of several flat groups. Its gather and free are the
# moves of Section 2 around a collective, launched asynchronously: `_start_gather` grows
# each buffer's storage back and starts `comm.all_gather(b.full, b.shard, async_op=True)`,
# `_gather` also waits on the handles, `_free_unit` resizes the storages to 0 bytes. Its
# forward hook frees the unit and hooks the output, as yours did, and the other hooks
# place the gathers:

# %%
excerpt(Zero3Engine, ("def _pre_forward", "def _pre_forward"),
        ("self._gather(unit)  # this unit first", "self._start_gather(ahead)"),
        ("def _pre_backward", "def _pre_backward"),
        ('comm.unit(unit.name, "backward: gather")', "self._start_gather(self._previous(unit))"),
        ("def _on_bucket_ready", "def _on_bucket_ready"), ("if all(other.complete", "self._free_unit(unit)"))

# %% [markdown]
# In forward the unit to prefetch (`ahead`) came next in the last forward
# (`units.Schedule`): ranks that run the same units issue the same gathers, with nothing
# exchanged; in debug mode (`ZEROLEARN_DEBUG_COLLECTIVES=1`) they also compare notes, and
# a rank that takes another branch is named before anything pairs wrongly. Backward walks the units in reverse, so the unit to
# prefetch there is the previous one. (By default a prefetch also takes the units after
# that one while all together hold at most `prefetch_mb` (4 MiB) and a bucket, in one
# all_gather through one fused buffer, `units.FusedGather`, the constant-size buffers of
# Sec 6.2: on units this small each collective's fixed cost outweighs its bytes. This
# chapter's runs set `prefetch_mb=0`, one unit per all-gather, so that every unit's
# gather shows.)
#
# ## 4. Prefetch, measured
#
# While unit $k$ computes, unit $k+1$'s all-gather is already in flight. The recording
# (`zerolearn.timeline`, as in chapter 1) ran the package's ZeRO-3 engine on two ranks
# with prefetch on, and with hooks that gather only their own unit (prefetch off). It
# used a wider GPT (4 blocks of width 64, Psi = 234,880), so that a block computes long
# enough to hide part of its neighbour's gather:

# %%
from zerolearn.chapters import stored

PF = stored("timeline/prefetch.json")
for run in PF["runs"]:
    gathers = [i for i in run["intervals"] if i["rank"] == 0 and i["lane"] == "comm" and i["phase"] == "forward"]
    hooks = {u: sum(i["unit"] == u for i in gathers) for u in dict.fromkeys(i["unit"] for i in gathers)}
    print(f"prefetch {'on ' if run['prefetch'] else 'off'}: {len(gathers)} all-gathers in forward, "
          f"issued from the hooks of {hooks}")

# %%
figures.prefetch_figure(PF)

# %% tags=["nbval-ignore-output"]
for run in PF["runs"]:
    print(f"prefetch {'on ' if run['prefetch'] else 'off'}: {run['forward_overlap']:.0%} of the forward "
          f"all-gathers hidden behind compute, forward blocked {run['forward_wait_s'] * 1e3:.1f} ms, "
          f"step {run['step_s'] * 1e3:.1f} ms")

# %% [markdown]
# ## 5. Measured: every stage on two real ranks
#
# `all_stages` trains the book's GPT under each stage, one after the other, on two gloo
# ranks spawned from this notebook (one spawn for all four runs: on every rank it calls
# `zerolearn.train.train(config.replace(stage=s))` for s = 0 to 3). Each run takes 3
# steps of a global batch of 8 sequences and writes the report of `zerolearn.train`;
# `--memory-timeline` keeps the ledger's timeline of the last step.

# %%
RUN = TrainConfig(**BOOK, bucket_mb=0.25, prefetch_mb=0, global_batch_size=8, steps=3, dtype="bf16",
                  memory_timeline=True)
reports = launch(ch04.all_stages, 2, RUN)[0]  # rank 0's reports, stages 0-3
for r in reports:
    losses = ', '.join(f'{v:#.3g}' for v in r['losses'])  # bf16: 3 significant digits
    print(f"stage {r['config']['stage']} {STAGE_NAMES[r['config']['stage']]:<9} losses {losses}")

# %% [markdown]
# The losses agree: ZeRO changes where states live, not the arithmetic. Now the bytes
# rank 0 holds, measured from its tensors, beside the formula
# `model_state_bytes(psi, nd, stage, k=12)` (Sec 5, Fig 1):

# %%
rows = []
for r in reports:
    stage, held, formula = r['config']['stage'], r['ranks'][0]['model_state_bytes'], r['analytic']['model_state_bytes']
    pairs = [v for key in ('params', 'grads', 'optimizer_states') for v in (held[key], formula[key])]
    rows.append([f'{stage} {STAGE_NAMES[stage]}', *pairs])
print(text_table(['stage', 'params B', 'formula', 'grads B', 'formula', 'optim B', 'formula'], rows))

# %% [markdown]
# Every measured byte count equals the formula: the shards divide evenly here, so
# there is no padding. Next, the elements rank 0's collectives moved per step, and
# their total in units of Psi, the paper's count: 2 x all-reduce + reduce-scatter +
# all-gather elements (Sec 7.1), beside Sec 7's 2 Psi and 3 Psi:

# %%
rows = []
for r in reports:
    stage, steps, entry = r['config']['stage'], len(r['losses']), r['ranks'][0]
    per_op = [entry['comm'][op]['elements'] // steps for op in ('all_reduce', 'reduce_scatter', 'all_gather')]
    moved = volume_per_step(entry, steps) / r['num_params']
    rows.append([f'{stage} {STAGE_NAMES[stage]}', *per_op, f'{moved:.3f}', f'{comm_volume_elements(1, stage):.1f}'])
print(text_table(['stage', 'all_reduce', 'reduce_scatter', 'all_gather', 'Psi/step', 'Sec 7'], rows))
print(f'Psi = {psi:,}')

# %% [markdown]
# Stages 0 to 2 move 2 Psi per step; ZeRO-3 moves 3 Psi: one Psi all-gathered in
# forward, one again in backward, one reduce-scattered as gradients.
#
# ## 6. The sawtooth
#
# The ledger recorded every allocation, free and resize of rank 0 during the last step
# of the ZeRO-3 run. Plotting only the `params` category shows the schedule of
# Section 3: each rise is an all-gather into a unit's buffer, each fall a unit freed.
# The dotted lines mark the shards, the shards plus one block, and the shards plus
# two blocks.

# %%
z3 = reports[3]
shards = z3['ranks'][0]['model_state_bytes']['params']
block = 2 * (12 * 32**2 + 13 * 32)  # bytes of one gathered block in bf16
fig = figures.timeline_figure(z3, ('params',), title='ZeRO-3, rank 0 of 2: parameter bytes over one step')
ax = fig.axes[0]
last = len(figures.timeline_series(z3)['index']) - 1
for n, label in ((0, 'shards'), (1, 'shards + 1 block'), (2, 'shards + 2 blocks')):
    ax.axhline((shards + n * block) / 2**10, color='gray', linestyle=':', linewidth=1)
    ax.annotate(label, (last, (shards + n * block) / 2**10), fontsize=8, va='bottom', ha='right')
fig

# %%
series = figures.timeline_series(z3)
params = series['by_category']['params']
print(f'shards (formula, 2 Psi / Nd): {model_state_bytes(psi, 2, 3)["params"]:>9,} bytes')
print(f'lowest over the step        : {min(params):>9,} bytes')
print(f'highest over the step       : {max(params):>9,} bytes = shards + {(max(params) - shards) / block:.2f} blocks')
print(f'all-gathers into a buffer   : {sum(1 for a, b in zip(params, params[1:], strict=False) if b > a)}')

# %% [markdown]
# Forward climbs unit by unit, never above two gathered blocks; at the end of forward
# only the shards remain. Backward gathers each unit again in reverse order. At no
# moment does a rank hold the whole model: that is Sec 4's observation that not all
# states are needed at all times, turned into a schedule.

# %% [markdown]
# ## 7. Table 1's trend at Nd = 8, 64 and 1024
#
# Two CPU cores cannot run 1024 ranks, but rank 0's memory does not need the others: `python -m zerolearn.train --simulate-world-size N` runs
# rank 0 of N ranks in one process on torch's "fake" process group, whose collectives
# move no data. Every flat buffer is padded and sharded for N ranks: rank 0 holds the
# bytes of a real N-rank job. `ch04.simulate(stage, nd, config)` is
# that command run in this process,
# `train_here(config.replace(stage=stage, simulate_world_size=nd))`.
#
# We run the book's GPT (one flat buffer per stage: `--bucket-mb 64`) under each ZeRO
# stage at Nd = 8, 64 and 1024, one sequence per rank, and print the bytes beside the
# formula, then each stage's *ratio* to DP's 16 Psi. Table 1 is in GB for models of
# 7.5B parameters and more; the ratio carries over to any model size (31.4 / 120 =
# 0.262 for P_os at Nd = 64). Its last column is that ratio from Table 1's
# numbers, where Table 1 has the Nd. Table 1 is an image in the paper: `TABLE1_GB` is a
# transcription of it, whose every value the formula gives to the digits shown.

# %%
SMALL = TrainConfig(**BOOK, steps=1, dtype="bf16", bucket_mb=64)
small_psi, held, ratios = ch04.table1_rows(SMALL, (8, 64, 1024))
print(f'Psi = {small_psi:,} parameters; DP holds 16 Psi = {16 * small_psi:,} bytes at every Nd')
print(text_table(['Nd', 'stage', 'measured B', 'formula B', 'padding', 'formula(Psi+pad)'], held))
print(text_table(['Nd', 'stage', 'measured/DP', 'Table 1/DP'], ratios))

# %% [markdown]
# The measured bytes equal the formula until Nd no longer divides the flat buffers.
# Then each buffer is padded with zeros to a multiple of Nd (the `padding` column, in
# elements; at stage 3 every unit has buffers of its own, so there is more of it), and
# the formula applied to Psi plus the padding gives the measured bytes exactly. At
# Nd = 1024 a rank of this tiny model holds a few hundred bytes under P_os+g+p and the padding is a
# few percent of Psi, which is why the measured ratios drift from Table 1's there; for
# a model of billions of parameters the same few thousand elements are negligible.
# Otherwise the ratios follow Table 1 up to the rounding of its GB figures (16.6 GB for
# 16.64): P_os tends to 4/16 of DP's memory, P_os+g to 2/16, and P_os+g+p keeps falling
# as 1/Nd, the only stage with no floor.

# %% [markdown]
# ## 8. Your engine trains
#
# Your `gather_hooks` is the last part of the engine assembled since chapter 1,
# `zerolearn.nano.NanoZero` (`zerolearn/nano.py`, under 300 lines, read top to bottom):
# each stage is a few lines that call the exercises' functions, yours where you pass them,
# the book's solutions elsewhere. At stage 3 it gives every unit a flat buffer of its own,
# keeps the rank's shard, frees the buffer and hands the unit to your hooks:

# %%
from zerolearn.chapters.your_engine import your_engine
from zerolearn.nano import NanoZero

excerpt(NanoZero._build_units, ("for unit in units:", "flat = Flat("), ("self.shards.append", "self.shards.append"),
        ("flat.full.untyped_storage().resize_(0)", "flat.full.untyped_storage().resize_(0)"),
        ('self.fn["reduce_scatter_hook"](mine', 'self.fn["reduce_scatter_hook"](mine'),
        ("if self.prefetch:", 'self.fn["gather_hooks"]'))

# %% [markdown]
# The cell below trains the book's GPT with it for 4 Adam steps on 2 ranks, beside one
# process and the package's `Zero3Engine`. Look for the losses of one process, the bytes
# per rank equal to Fig 1's formula with every state divided by Nd, and 3 Psi moved per
# step.

# %%
your_engine(3, {"gather_hooks": gather_hooks})

# %% [markdown]
# `your_engine(3, {"prefetch": prefetch}, prefetch=True)` gathers with your `prefetch`
# instead, the next unit's all-gather in flight while one computes: the order of the
# collectives changes, not what they move, and the row is the same.
#
# What the package's engine adds to these few lines at stage 3:
#
# | the package's engine adds | why | where |
# |---|---|---|
# | small units in one fused all-gather (`prefetch_mb`) | one fixed cost per window, not per unit | §3; ch. 5 (CB), 7 |
# | asynchronous reduce-scatters in buckets of `bucket_mb` | overlap with backward; bounded buffers (Sec 5.2) | ch. 3 |
# | a unit schedule every rank follows, checked in debug mode | collectives pair by order: a rank on another branch hangs | §3; ch. 7 |
# | units kept gathered for checkpointing's recompute | backward needs them again at once | docs/ARCHITECTURE.md |
# | bf16 or fp16 parameters, fp32 master, loss scale | 2-byte forward and backward (Sec 3.1) | ch. 0 |
# | shards on the host or on disk; quantized gathers | fewer GPUs; less traffic between nodes | ch. 8 |

# %% [markdown]
# ### Exercise 3 · your whole engine
#
# Write `nano_engine(model, stage, lr)` that returns `NanoZero(model, stage, lr,
# parts=...)` with your own functions: `gather_hooks` (or `prefetch`, with
# `prefetch=True`) from this chapter, and any of `bucket_hook`, `shard_range`,
# `zero1_step` and `reduce_scatter_hook` from chapters 1-3 that you paste into a cell
# above. A part you leave out is the book's solution. The checker first runs each part
# you pass through its own exercise's check, so a bug in a part is named with that
# exercise's words; then it trains the MLP with Adam at stages 0-3 on 2 and on 3 ranks
# against one process, with Fig 1's bytes and 2 / 2 / 2 / 3 Psi per step.

# %% tags=["exercise"]
# exercise: 04.nano_engine

# %%
exercises.check("04.nano_engine", nano_engine)

# %% [markdown]
# ### A ZeRO file to take home
#
# Your functions of chapters 1-4 make a whole ZeRO-DP. `take_home.write` writes them into
# one file, `my_zero.py`: `flatten_params` lays out the buffers, `average_gradients` is DP's
# all-reduce, `zero1_step` every stage's step, `reduce_scatter_hook` and `gather_hooks` the
# hooks of stages 2 and 3. The file needs torch alone. What it lacks is the program around
# them, `main()`: chapter 1's first exercise at full size.

# %% [markdown]
# ### Exercise 4 · the program
#
# Write `main()`, which torchrun runs on every rank. Read the stages from
# `parse_args().stage` (a list: `--stage 0 1 2 3`), join the gloo process group and take the
# rank and world size from it. For each stage, build the model (`build_model()`: a small MLP,
# 4 Linear(64, 64) layers), wrap it in `Engine(model, stage, rank, world_size)` and train
# `STEPS` steps: this rank's slice of each global batch (`my_slice(t, rank, world_size)` of
# each tensor of `batch(step)`), `F.mse_loss` of `engine.model(x)` against `y`,
# `engine.backward(loss)`, `engine.step()`, keeping each `loss.item()`. Then
# `report(engine, losses)` checks every rank against one process on the whole batch (rel.
# 1e-6) and the bytes against Fig 1's formula for fp32 with an fp32 master, prints on rank 0,
# and returns True when a stage was wrong. Leave the group, and exit with status 1
# (`sys.exit(1)`) when any stage was wrong, so that torchrun and any script around it see it.

# %% [markdown]
# The checker writes `my_zero.py` with your `main()` and the book's other parts and runs it
# under torchrun at stages 0-3 on 2 and 3 ranks; then once more with a wrong part (an
# `average_gradients` that never divides by the world size), where every rank must exit
# with status 1.

# %% tags=["exercise"]
# exercise: 04.main

# %%
exercises.check("04.main", main)

# %% [markdown]
# Now the file with your parts. A part this notebook does not define, or that still raises
# `NotImplementedError`, is not filled in for you: `write` names it and writes nothing,
# unless you ask for the book's solution by name in `book_parts`. Paste your functions of
# chapters 1-3 above to take all of yours; the cell below takes the book's for those.

# %%
from zerolearn.chapters.ch04 import take_home

mine = {name: globals()[name] for name in take_home.PARTS if name in globals()}  # your functions here
book_parts = ["average_gradients", "flatten_params", "zero1_step", "reduce_scatter_hook"]  # chapters 1-3's
print(take_home.write("my_zero.py", mine, book_parts=[n for n in book_parts if n not in mine]))

# %% [markdown]
# Run it on two ranks, as you ran chapter 1's first script: type the line in the next cell,
# with `my_zero.py --stage 0 1 2 3` at its end.

# %% tags=["reader-types"]
import sys

# !OMP_NUM_THREADS=1 {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 my_zero.py --stage 0 1 2 3

# %% [markdown]
# Every stage ends at the loss of one process, and the bytes fall as Fig 1 says: the
# optimizer states halve at ZeRO-1, the gradients at ZeRO-2, the parameters at ZeRO-3. A
# stage that differs on any rank prints that rank and what differs, and the run exits with
# status 1. The file is yours: run it with `--nproc-per-node 3` too, where Ψ = 16,640 does not
# split into 3 equal shards and the padding elements show in the bytes.

# %% [markdown]
# ## Questions
#
# Write down a number for each question, then run the cell under it.
#
# **1.** Repeat Section 2's common way of freeing with a `Linear(128, 128)`: how many
# bytes of parameters are still live after the "free", while the graph of a forward
# exists?

# %%
with MemoryLedger() as ledger:
    layer, full = gathered_linear(128)
    y = layer(torch.randn(4, 128, requires_grad=True))
    layer.weight.data, full = torch.empty(0), None  # the common way: empty the parameter, drop the buffer
    print(f"{ledger.live['params']:,} bytes of parameters live after the 'free'")

# %% [markdown]
# **2.** In Section 3's schedule of the book's GPT (fp32, one rank), what is the most
# bytes of gathered parameters alive at once with prefetch, and without it?

# %%
for on in (True, False):
    sched = schematics.zero3_schedule(build_model('gpt', 0, gpt=GPT), tokens, prefetch=on)
    print(f"prefetch {'on ' if on else 'off'}: at most {max(e.alive_bytes for e in sched.events):,} bytes gathered")

# %% [markdown]
# **3.** How many bytes of bf16 parameters does rank 0 keep under ZeRO-3 at Nd = 16,
# for the book's GPT?

# %%
r = ch04.simulate(3, 16, SMALL.replace(global_batch_size=16))
print(f"rank 0 of 16 keeps {r['ranks'][0]['model_state_bytes']['params']:,} bytes of parameters")

# %% [markdown]
# **4.** Table 1's last row: how many GB per GPU do $P_{os}$, $P_{os+g}$ and
# $P_{os+g+p}$ need for a trillion parameters on 1024 GPUs (K = 12)? Compute them with
# the formula your measurements matched. (The table is an image in the paper; beside
# each answer is our transcription of its cell.)

# %%
for stage in (1, 2, 3):
    gb = model_state_bytes(1e12, 1024, stage)['total'] / 1e9
    print(f"{STAGE_NAMES[stage]:<9} {gb:,.2f} GB per GPU; Table 1, transcribed: {TABLE1_GB[10**12][1024][stage - 1]}")

# %% [markdown]
# ## Summary
#
# * ZeRO-3 partitions the last replicated model state, the parameters: every rank
#   holds (2 + 2 + K) Psi / Nd bytes of model states, the Nd-fold cut of Fig 1 and
#   Sec 5.3.
# * Parameters are gathered just before their forward and again before their backward,
#   freed right after, the gathers pipelined with the passes (Sec 7.2.2). The package
#   does it per unit, with the neighbour's gather prefetched: live parameters are the
#   shards plus about two units (measured: exactly two blocks).
# * Freeing must release the storage: reassigning `.data` leaves the bytes alive in
#   autograd's saved views until the graph dies; resizing the storage to 0 bytes
#   releases them at once and lets the same views be re-filled before backward.
# * The price is traffic: 3 Psi per step instead of 2 Psi (Sec 7.2.2), measured by the
#   communication ledger.
# * Per-rank memory measured at Nd = 8, 64 and 1024 follows the formula (up to
#   padding) and Table 1's trend: only P_os+g+p keeps falling as 1/Nd.
#
# Chapter 6 takes these formulas to the paper's scale: Table 1, Table 2, and which
# hardware fits which model.
