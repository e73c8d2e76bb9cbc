# %% [markdown]
# # Chapter 6 · At scale, on paper and measured
#
# The paper's claims are about billions of parameters on hundreds of GPUs: a 7.5B
# model in 1.9 GB per GPU at Nd = 64 (Fig 1), a trillion parameters on 1024 GPUs
# (Table 1), a 60B model that trains faster per GPU as GPUs are added (Fig 3). This
# chapter checks each claim with the formulas of `zerolearn.memory` at the paper's
# scale, and with our engines where a CPU can measure it (chapter 4's simulated world
# size plays rank 0 of up to 1024 ranks).
#
# **Learning goals.** After this chapter you can
#
# 1. reproduce Table 1 and Table 2 from the formulas and say where the printed values
#    are rounded;
# 2. measure Table 1's trend on real shards, up to Nd = 1024, on one CPU;
# 3. answer "can my hardware fit this model?", activations included;
# 4. weigh memory against communication, and estimate step time with a first-order
#    cost model;
# 5. explain the super-linear scaling of Sec 10.3 (Fig 3);
# 6. use the five explorers of `zerolearn.widgets`.
#
# Each explorer below is shown live (it needs a running kernel) and as a static figure
# of its default view.

# %%
# %matplotlib inline
from IPython.display import display

from zerolearn import figures, widgets
from zerolearn.chapters.ch04 import lesson as ch04
from zerolearn.chapters.ch06 import lesson as ch06
from zerolearn.chapters.source import excerpt
from zerolearn.config import TrainConfig
from zerolearn.costmodel import Job, step_time
from zerolearn.dist import launch
from zerolearn.memory.fit import ActivationSpec, gpt_params, per_device_bytes, smallest_fit
from zerolearn.memory.model import GB, STAGE_NAMES, TABLE1_GB, V100_BYTES, max_model_params, model_state_bytes
from zerolearn.tables import text_table

# %% [markdown]
# ## 1. Table 1 from the formulas
#
# Table 1 lists the model-state memory per device for three model sizes and six
# data-parallel degrees, with mixed-precision Adam (K = 12): P_os holds
# 4 Psi + 12 Psi / Nd bytes, P_os+g 2 Psi + 14 Psi / Nd, P_os+g+p 16 Psi / Nd (Sec 5).
# `ch06.table1_rows` computes each entry with `model_state_bytes` beside the printed
# value:

# %%
excerpt(ch06.table1_rows)

# %%
worst = 0.0
for psi in TABLE1_GB:
    print(f'Psi = {psi / 1e9:g}B parameters, GB per device (computed | printed)')
    rows = []
    for row in ch06.table1_rows(psi):
        cells = [f'{c:,.2f} | {p:g}' for c, p in zip(row['computed'], row['printed'], strict=True)]
        rows.append([row['nd'], *cells])
        worst = max(worst, *(abs(c - p) / p for c, p in zip(row['computed'], row['printed'], strict=True)))
    print(text_table(['Nd', 'P_os', 'P_os+g', 'P_os+g+p'], rows), end='\n\n')
print(f'largest relative difference from the printed values: {100 * worst:.1f} %')

# %% [markdown]
# The formulas give every entry. The differences are the paper's rounding: it prints
# about three significant digits, some of them cut rather than rounded (513.5 is
# printed 513, 257.75 as 257), and small values with two (0.1171875 as 0.12). The bottom-right entry
# is the paper's headline: a trillion parameters need
# 15.6 GB per device at Nd = 1024 under P_os+g+p, which fits a 32 GB V100 (Sec 1).
#
# ## 2. Table 1 measured, up to Nd = 1024
#
# The bytes rank 0 holds are set by its shards, not by the other ranks, so the
# simulated world size of chapter 4 (`--simulate-world-size`, torch's fake process
# group) measures them for any Nd on one CPU. We train one step of the book's GPT
# (Psi = 42,368) under each stage at the Nd of Table 1 and divide the measured bytes
# by DP's 16 Psi: Table 1's entries divided by its Nd = 1 column give the same ratios,
# whatever the model size.

# %%
excerpt(ch06.measure_per_rank)

# %%
SMALL = TrainConfig(d_model=32, n_head=2, seq_len=16, steps=1, dtype="bf16", bucket_mb=64)
NDS = (4, 16, 64, 256, 1024)
measured = ch06.measure_per_rank((1, 2, 3), NDS, SMALL) + ch06.measure_per_rank((0,), (1024,), SMALL)
small_psi = measured[0]['psi']
rows = []
for m in measured:
    formula = model_state_bytes(m['psi'], m['nd'], m['stage'])['total']
    # Table 1 has no DP column: DP holds 16 Psi at every Nd, 120 GB for Psi = 7.5B.
    ratio = 1.0 if m['stage'] == 0 else TABLE1_GB[7_500_000_000][m['nd']][m['stage'] - 1] / 120
    rows.append([m['nd'], f"{m['stage']} {STAGE_NAMES[m['stage']]}", m['bytes'], f'{formula:,.0f}', m['padding'],
                 f"{m['bytes'] / (16 * small_psi):.4f}", f'{ratio:.4f}'])
print(f'Psi = {small_psi:,}; 16 Psi = {16 * small_psi:,} bytes')
print(text_table(['Nd', 'stage', 'measured B', 'formula B', 'padding', 'measured/DP', 'Table 1/DP'], rows))

# %% [markdown]
# DP measured at Nd = 1024 holds exactly 16 Psi: data parallelism alone never divides
# anything. For the ZeRO stages the measured bytes equal the formula wherever Nd
# divides the flat buffers, and exceed it by the padding (in elements) where it does
# not, which matters only for a model this small. The figure puts the measurements on
# Table 1's curves:

# %%
ch06.table1_figure(measured, NDS)

# %% [markdown]
# ## 3. Table 2: the largest model that fits
#
# Table 2 turns the formulas around: with 32 GB per V100 and Nd = 64 data-parallel
# ranks, how many parameters fit per stage, with model parallelism (MP) of degree
# 1 to 16 on top? Its theoretical column counts model states only.
#
# ### Exercise 1 · the largest model per stage
#
# Write `max_psi(device_bytes, nd, stage, nm=1, k=12)`: the largest Psi whose model
# states fit one device, for 2-byte parameters and gradients and `k` bytes of optimizer
# state per parameter. Model parallelism of degree `nm` gives each device Psi / Nm of the
# parameters; ZeRO then divides by Nd what the stage partitions. Return the number of
# parameters as a float, unrounded.
#
# `exercises.check` tries every row of Table 2 (32 GB, Nd = 64, MP 1 to 16, all four
# stages), then other devices, Nd and K, against `zerolearn.memory.model` and names the
# first case that differs with the bytes per parameter the stage holds. Your functions may
# use `torch`, `nn`, `F`, `dist` and `comm` besides their arguments; the next cell imports
# them and the checker.

# %%
import torch  # noqa: F401 - for the exercises' functions
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from torch import nn  # noqa: F401

from zerolearn import comm, exercises  # noqa: F401

# %% tags=["exercise"]
# exercise: 06.max_psi

# %%
exercises.check("06.max_psi", max_psi)

# %% [markdown]
# The package's `max_model_params` solves `model_state_bytes(psi, ...) = 32e9` for Psi.
# Beside the values Table 2 prints:

# %%
rows = [[f"{r['mp']} x {r['gpus'] // r['mp']}", r['gpus'],
         *(f'{c:,.1f} | {p:g}' for c, p in zip(r['computed'], r['printed'], strict=True))] for r in ch06.table2_rows()]
print('largest Psi in billions of parameters (computed | printed), 32 GB per GPU')
print(text_table(['MP x Nd', 'GPUs', 'DP', 'P_os', 'P_os+g', 'P_os+g+p'], rows))

# %% [markdown]
# The rows with MP > 1 are printed as multiples of the first row's rounded values
# (121.6 = 16 x 7.6), and the last column's trillions to one digit: "0.5T", "1T" and
# "2T", which the table reads as 500, 1,000 and 2,000B, where the formula gives 512,
# 1,024 and 2,048B. So they agree to about 3%. The paper also *measured* the largest
# model it could train under P_os, and it is smaller (6.2B at 64 GPUs against 7.6B in
# theory, Table 2): activations, temporary buffers and fragmentation (Sec 3.2) need
# memory too. Table 2's caption reads the two as matching: the analysis gives a
# realistic upper bound.
#
# We cannot train 7.6B parameters here, but we can measure the quantity the column is
# made of: the bytes per parameter a rank holds at Nd = 64, from the simulated runs
# of Section 2. Dividing 32 GB by it gives the largest Psi our engines would fit:

# %%
rows = []
for stage in (1, 2, 3):
    m = next(m for m in measured if m['stage'] == stage and m['nd'] == 64)
    per_param = m['bytes'] / m['psi']
    rows.append([f'{stage} {STAGE_NAMES[stage]}', f'{per_param:.4f}', f'{V100_BYTES / per_param / 1e9:,.1f}',
                 f'{max_model_params(V100_BYTES, 64, stage) / 1e9:,.1f}'])
print(text_table(['stage', 'measured bytes/param', 'largest Psi (B), measured', 'formula (B)'], rows))

# %% [markdown]
# P_os and P_os+g match to the digit. At P_os+g+p the 64 padding elements of our tiny
# model add 0.15% to the bytes per parameter; on a 128B model they would vanish.
#
# ## 4. Can my hardware fit this model?
#
# The question people bring to the paper: given a model and a GPU, which stage and how
# many GPUs? A good rule: the fewest GPUs first, then the lowest stage, since lower
# stages partition less and never communicate more (Sec 7).
#
# ### Exercise 2 · the fewest GPUs
#
# Write `fewest_gpus(psi, device_bytes, max_nd=1024)`: the `(stage, nd)` of that rule for
# model states only, bf16 with Adam (K = 12), trying Nd = 1, 2, ... up to `max_nd`, or
# None when nothing fits. A model that fills a device exactly fits. The checker tries
# models from 1.5B to 10T parameters on 32 to 141 GB devices against the package's
# solver.

# %% tags=["exercise"]
# exercise: 06.fewest_gpus

# %%
exercises.check("06.fewest_gpus", fewest_gpus)

# %% [markdown]
# The package's fit solver, `zerolearn.memory.fit.smallest_fit`, follows the same rule
# and can add residual states, as below. A 7B model in bf16 with Adam on 80 GB GPUs:

# %%
fit = smallest_fit(7e9, 80 * GB)
print(f'stage {fit.stage} ({fit.stage_name}) on {fit.gpus} GPU(s): {fit.bytes_per_device / GB:.1f} GB per GPU, '
      f'{100 * fit.utilization:.1f} % of 80 GB')

# %% [markdown]
# On one GPU every stage holds 16 x 7 = 112 GB. On two, P_os already fits:
# 4 x 7 + 12 x 7 / 2 = 70 GB. The same question for a few models and GPUs
# (`figures.GPUS` lists nominal sizes in the paper's decimal GB):

# %%
models = {'1.5B': 1.5e9, '7B': 7e9, '13B': 13e9, '70B': 70e9, '175B': 175e9, '1T': 1e12}
gpus = ['V100 32 GB', 'A100 40 GB', 'H100 80 GB', 'H200 141 GB']
rows = []
for name, psi in models.items():
    cells = []
    for gpu in gpus:
        f = smallest_fit(psi, figures.GPUS[gpu])
        cells.append('-' if f is None else f'{f.gpus} x stage {f.stage}')
    rows.append([name, *cells])
print('fewest GPUs x lowest stage, model states only (bf16, Adam, K = 12)')
print(text_table(['model', *gpus], rows))

# %% [markdown]
# Model states are not all. Residual states (Sec 3.2) do not shrink with Nd, so a batch
# can change the answer: activations (about 60 GB for GPT-2 1.5B, 48 layers, hidden
# 1600, at 1024 tokens and 32 sequences per GPU; about 5 GB with one checkpoint per
# block, where Sec 3.2 quotes about 8 GB for its checkpointing), the working set of
# recomputing one block in backward (1.3 GB), and
# the fused fp32 buffer into which DP gathers every gradient for the all-reduce (6.2 GB,
# Sec 3.2's "6 GB"). Passing an `ActivationSpec` counts all three; fragmentation has no
# size to add (chapter 5):

# %%
gpt2 = gpt_params(48, 1600)
for label, act in [('model states only', None),
                   ('+ activations, batch 32', ActivationSpec(1600, 48, 32, 1024)),
                   ('+ checkpointed activations', ActivationSpec(1600, 48, 32, 1024, checkpointing=True))]:
    f = smallest_fit(gpt2, 32 * GB, activation=act)
    answer = 'does not fit on 1024 GPUs' if f is None else (
        f'stage {f.stage} on {f.gpus} GPU(s), {f.bytes_per_device / GB:.1f} GB each')
    print(f'GPT-2 1.5B on 32 GB, {label:<27}: {answer}')
dp = per_device_bytes(gpt2, 1, 0, activation=ActivationSpec(1600, 48, 32, 1024, checkpointing=True))
print('\nDP on one GPU, checkpointed, GB: ' + ', '.join(
    f'{k} {dp[k] / GB:.1f}' for k in ('params', 'grads', 'optimizer_states', 'activations', 'recompute',
                                       'temporary_buffers', 'total')))

# %% [markdown]
# This is the paper's Sec 3 point: 3 GB of fp16 weights, yet plain DP cannot train GPT-2
# 1.5B at batch 32 on a 32 GB V100, even with checkpointing (37.4 GB: 24.9 of model states,
# 12.5 of residual states). Partitioning the optimizer states over two GPUs is enough.
# Without checkpointing, 60 GB of activations exceed a 32 GB device however many GPUs
# share the model states: that is why the paper pairs ZeRO-DP with activation
# checkpointing and, for the largest models, with P_a (Sec 6.1).
#
# The fit solver as an explorer: move the model size, pick a GPU, change the optimizer
# or the working dtype. The summary gives the answer and the fewest GPUs for each
# stage; the figure shows each stage's memory per GPU against Nd, the device's line,
# and the answer as a star.

# %%
display(widgets.FitSolver())

# %%
figures.fit_figure()  # the default view: 7B parameters on 80 GB GPUs

# %% [markdown]
# ## 5. Where the memory goes: the memory explorer
#
# The memory explorer draws Fig 1 for any setting: each stage's bytes per device by
# category, against one device. The default is Fig 1's own setting (Psi = 7.5B,
# Nd = 64, K = 12, a 32 GB V100). Tick "add activations" to put the activations of a
# GPT of the given shape on top.

# %%
display(widgets.MemoryExplorer())

# %%
figures.memory_figure()  # Fig 1: 120, 31.4, 16.6, 1.9 GB

# %% [markdown]
# ## 6. Memory against communication
#
# Stages 1 and 2 cost nothing in traffic: a reduce-scatter plus an all-gather moves the
# same 2 Psi as DP's all-reduce (Sec 7). Stage 3 moves 3 Psi, 1.5 times as much
# (Sec 7.2.2), and in exchange divides the last replicated state. The trade-off
# explorer shows both at once: memory per device against Nd on the left, and at the
# chosen Nd each stage's memory against its traffic relative to DP on the right.

# %%
display(widgets.TradeOff())

# %%
figures.tradeoff_figure()  # Psi = 7.5B, Nd = 64

# %% [markdown]
# Whether 1.5 times the traffic matters depends on how long the step computes. The
# cost model (`zerolearn.costmodel`) is first-order: compute is 6 flops per parameter
# per token (8 with recomputation) at an achieved FLOP/s, communication is the
# paper's volume through the ring's slowest link, and a fraction of it can hide behind
# compute:

# %%
excerpt(step_time, ("compute_s = flops_per", "volume_bytes=volume_bytes, collectives"))

# %% [markdown]
# A 7.5B model on 64 GPUs of the paper's cluster (`ch06.DGX2`: 40 TFLOP/s achieved per
# GPU; between nodes the paper's 800 Gbps per node of 16 GPUs, Sec 10.1, which is
# 6.25 GB/s per GPU), no overlap, at two batch sizes:

# %%
rows = []
for tokens in (1024, 16 * 1024):
    for stage in range(4):
        t = step_time(Job(psi=7.5e9, tokens_per_gpu=tokens, stage=stage, nd=64), ch06.DGX2)
        rows.append([tokens, f'{stage} {STAGE_NAMES[stage]}', f'{t.compute_s:.2f}', f'{t.comm_s:.2f}',
                     f'{t.step_s:.2f}', f'{t.comm_to_compute:.2f}'])
print(text_table(['tokens/GPU', 'stage', 'compute s', 'comm s', 'step s', 'comm/compute'], rows))

# %% [markdown]
# Communication per step does not depend on the batch; compute grows with it. With one
# sequence of 1024 tokens per GPU, communication dominates the step, and ZeRO-3's extra
# 50% of traffic alone costs about twice the whole compute; with 16 sequences per GPU
# communication is about a quarter (DP, 0.26) to two fifths (ZeRO-3, 0.38) of the compute. This is the
# paper's reasoning for why ZeRO keeps DP's efficiency: the traffic stays within a
# constant factor of DP's, and large per-GPU batches hide it.

# %% [markdown]
# ## 7. Super-linear scaling (Sec 10.3, Fig 3)
#
# The paper trains a 60B model with ZeRO-100B (P_os+g with model parallelism) on 64 to
# 400 GPUs and reports super-linear speedup: the aggregate throughput grows faster than
# the number of GPUs (Fig 3). The reason is memory. More data-parallel ranks divide the
# optimizer states and gradients further (Sec 5), which frees memory for activations,
# so each GPU can run a larger batch, and larger batches run at higher arithmetic
# intensity (Sec 10.3); per unit of compute they also move less data-parallel traffic,
# the argument of Sec 8. The model's shape and MP of 16 (one DGX-2 node) are the book's
# choices here: the paper lists its configurations in Table 6, an image in its text.
#
# The cost model can replay that argument. `costmodel.max_batch_per_gpu` finds the
# largest batch whose model states and residual states (checkpointed activations, one
# block's recomputation, ZeRO-R's constant-size buffer) fit 32 GB;
# `throughput_per_gpu` runs a step at that batch. How efficiency grows with batch is
# an *assumption* here (`EfficiencyCurve`: half of a 60 TFLOP/s peak at 4 sequences
# per GPU), not data from the paper:

# %%
excerpt(ch06.scaling_rows)

# %%
GPU_COUNTS = [64, 128, 192, 256, 320, 400]
scaling = {stage: ch06.scaling_rows(GPU_COUNTS, stage=stage) for stage in (0, 1, 2)}
rows = [[r['gpus'], r['nd'], r['batch'], f"{r['tflops_per_gpu']:.1f}", f"{r['aggregate_pflops']:.2f}",
         f"{scaling[2][0]['aggregate_pflops'] * r['gpus'] / 64:.2f}"] for r in scaling[2]]
print(f'60B model ({gpt_params(**ch06.GPT_60B) / 1e9:.1f}B parameters), stage 2, MP = 16, 32 GB per GPU')
print(text_table(['GPUs', 'Nd', 'batch/GPU', 'TFLOP/s per GPU', 'PFLOP/s total', 'linear from 64'], rows))
print('stage 0 (DP) batch per GPU:', [r['batch'] for r in scaling[0]])

# %%
ch06.scaling_figure(scaling, GPU_COUNTS)

# %% [markdown]
# DP does not fit the 60B model at all (batch 0 at every size): its 16 Psi / 16 bytes
# per GPU never shrink. Under P_os+g, going from 64 to 400 GPUs more than doubles the
# batch each GPU can hold, and per-GPU throughput rises with it, so the aggregate
# grows faster than linearly. Past 256 GPUs the batch stops growing: the activations and
# the recomputation, which no stage divides, fill what the model states freed. The shape
# follows from memory alone; the numbers follow from the assumed efficiency curve.
#
# ## 8. The measured timeline, per stage
#
# The formulas above count model states; the ledger measures everything a rank
# allocates. The timeline explorer shows one training step of each stage, measured on
# two real gloo ranks (`ch04.all_stages` with `--memory-timeline`). The model is a GPT of
# 4 blocks of width 64 (Psi = 234,880), deeper than the book's two blocks so that stage
# 3's timeline shows several units gathered and freed in turn. Pick a stage and the
# categories to draw.

# %%
RUN = TrainConfig(model="gpt", n_layer=4, d_model=64, n_head=4, seq_len=32, global_batch_size=8, steps=2,
                  dtype="bf16", memory_timeline=True, bucket_mb=0.25, prefetch_mb=0)
reports = launch(ch04.all_stages, 2, RUN)[0]
viewer = widgets.TimelineViewer(reports)
display(viewer)

# %%
figures.timeline_figure(reports[0])  # the default view: stage 0 (DP)

# %%
rows = []
for r in reports:
    entry = r['ranks'][0]
    at_peak = entry['memory']['peak_by_category']
    rows.append([f"{r['config']['stage']} {STAGE_NAMES[r['config']['stage']]}", entry['peak_bytes'],
                 *(at_peak[c] for c in ('params', 'grads', 'optimizer_states', 'activations', 'temporary'))])
print('rank 0 at its measured peak, bytes')
print(text_table(['stage', 'peak', 'params', 'grads', 'optim', 'activations', 'temporary'], rows))

# %% [markdown]
# The peak falls from DP to P_os and again at P_os+g+p, but much less than the model
# states do, and P_os+g's peak equals P_os's. At this size the activations and
# temporaries of one step are as large as the model states, and under P_os and P_os+g the peak
# comes at the end of forward, when activations are highest and no gradient exists yet:
# partitioning gradients cannot lower a peak that has no gradients in it. (DP's peak
# holds full gradients; P_os+g+p's is in backward.) This is the residual
# memory of Sec 3.2, which ZeRO-R addresses, and which becomes the limit once model
# states are partitioned.

# %% [markdown]
# ## 9. Fragmentation (Sec 3.2, Sec 6.3)
#
# Residual memory has one more source: fragmentation. In extreme cases the paper saw
# out-of-memory errors with over 30% of memory still available (Sec 3.2), because
# long-lived tensors (activation checkpoints, parameter gradients) end up scattered
# between short-lived ones (Sec 6.3). The
# fragmentation explorer replays the allocations of two real training steps of a
# 25.7M-parameter GPT (`figures.recorded_trace`, chapter 5 explains it) through the model
# of torch's caching allocator in `zerolearn.residual.defrag`: change the memory's size,
# turn MD (contiguous pools for the long-lived tensors) on and off, and scale the
# allocator's size classes (2 shrinks its segments to half their size).

# %%
display(widgets.FragmentationSimulator())

# %%
figures.fragmentation_figure()  # the default: the smallest arena that works with MD, here without it

# %% [markdown]
# ## Questions
#
# Write down a number for each question before you run the cell under it.
#
# **1.** A trillion parameters under P_os+g on Nd = 64 GPUs (bf16 and Adam, K = 12): how
# many GB per device? The bf16 parameters are not partitioned at this stage.

# %%
print(f"P_os+g, 1T parameters, Nd = 64: {model_state_bytes(1e12, 64, 2)['total'] / GB:,.2f} GB per device")

# %% [markdown]
# **2.** The book's GPT (Psi = 42,368) under P_os+g+p on 3 ranks: how many bytes of model
# states does rank 0 hold? 42,368 is not a multiple of 3, and every rank's shard has the
# same length.

# %%
m = ch06.measure_per_rank((3,), (3,), SMALL)[0]
print(f"rank 0 of 3 holds {m['bytes']:,} bytes ({m['padding']} padding elements); "
      f"16 Psi / 3 = {16 * m['psi'] / 3:,.1f}")

# %% [markdown]
# **3.** A 30B model on 40 GB A100s, model states only: which stage, on how many GPUs,
# by the rule of section 4 (the fewest GPUs, then the lowest stage)?

# %%
fit = smallest_fit(30e9, 40 * GB)
print(f"30B on 40 GB: stage {fit.stage} ({fit.stage_name}) on {fit.gpus} GPUs, "
      f"{fit.bytes_per_device / GB:.1f} GB each")

# %% [markdown]
# **4.** From the cost-model table of section 6, ZeRO-3 on 64 GPUs for the 7.5B model,
# with 4 sequences of 1024 tokens per GPU: what is communication over compute? (Compute
# grows with the tokens; communication does not.)

# %%
t = step_time(Job(psi=7.5e9, tokens_per_gpu=4 * 1024, stage=3, nd=64), ch06.DGX2)
print(f"stage 3, 4096 tokens per GPU: compute {t.compute_s:.2f} s, comm {t.comm_s:.2f} s, "
      f"comm/compute {t.comm_to_compute:.2f}")

# %% [markdown]
# **Beyond memory: time.** Memory is not the last wall (Sec 9). BERT-Large, 330M
# parameters, trains in 67 minutes on 1024 GPUs; at the same sequence length and number
# of samples, a trillion parameters is about 3000 times the computation. On the same
# 1024 GPUs:

# %%
print(f"Sec 9's estimate: 67 min x 1e12 / 330e6 = {ch06.trillion_days():.0f} days "
      "(the paper rounds to 140, and expects over a year with more data)")

# %% [markdown]
# ## Summary
#
# * Table 1 and Table 2's theoretical column follow from three formulas
#   (Sec 5); the printed values are those formulas rounded, to within 3%.
# * Measured on real shards with the simulated world size, rank 0's memory follows
#   Table 1's trend up to Nd = 1024; padding is the only difference, and it matters only
#   for tiny models.
# * The fit solver answers "can my hardware fit this model?": a 7B model on 80 GB GPUs
#   needs P_os on 2 GPUs at 70 GB each. Activations can change the answer, which is why
#   checkpointing goes with ZeRO.
# * Stages 1 and 2 are free in traffic; stage 3 costs 1.5x, which large per-GPU
#   batches hide.
# * More GPUs mean less memory per GPU for model states, hence larger batches and
#   higher efficiency per GPU: the super-linear scaling of Sec 10.3 (Fig 3).
# * At small scale the measured peak is dominated by residual memory (activations,
#   temporaries, fragmentation): the subject of ZeRO-R.
