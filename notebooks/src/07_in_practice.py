# %% [markdown]
# # Chapter 7 · In practice: PyTorch, DeepSpeed, and choosing a stage
#
# You will rarely train with this book's engines; you will use PyTorch's own sharding or
# DeepSpeed. This chapter puts them side by side with ours on the same job, maps our
# stages onto their options, and shows on our engines the pitfalls users of production
# systems hit most.
#
# **Learning goals.** After this chapter you can
#
# 1. run the same training with torch's `DistributedDataParallel`,
#    `ZeroRedundancyOptimizer` and FSDP2 (`fully_shard`) and check that it computes
#    what our stages compute;
# 2. read a DeepSpeed ZeRO config and say which of the paper's stages it runs;
# 3. choose a stage for a model and a machine, with the fit solver;
# 4. recognise three pitfalls: memory above the model-state estimate, stage 3 being slow
#    on small models, and hangs from ranks that take different code paths.

# %% [markdown]
# ## The same job, eight ways
#
# Each implementation below trains the same GPT for 4 Adam steps on the same global
# batches of 8 sequences, on 2 gloo ranks: our stages 0-3, torch DDP,
# `ZeroRedundancyOptimizer`, and FSDP2 with and without resharding after forward. The
# GPT has 2 blocks of width 64 (4 heads, sequences of 32 tokens, Psi = 134,912), twice
# the book's width: it is the model of the DeepSpeed runs stored with the book, which
# this chapter compares with ours below.

# %%
# %matplotlib inline
import importlib.util

from zerolearn import chapters, memory
from zerolearn.chapters.ch07 import lesson as ch07
from zerolearn.dist import launch

results = launch(ch07.side_by_side, 2)[0]
print(ch07.side_by_side_table(results))

# %% [markdown]
# ## Exercise 1 · which stage does it run?
#
# The bytes a rank holds tell which states an implementation partitions, and so which
# stage it runs. Write `stage_from_bytes(held, full)`: `held` is
# `{"params": ..., "grads": ..., "optimizer_states": ...}`, the bytes one rank holds, and
# `full` the same for one unpartitioned replica. A state is partitioned when the rank holds
# less of it than a replica, however unequal the shards. Return the stage, 0 to 3, and
# raise `ValueError` when the partitioned states match no stage.
#
# `exercises.check` tries every stage on 2, 3 and 4 ranks with padded flat shards, uneven
# whole-tensor shards such as `ZeroRedundancyOptimizer` makes, and two combinations no
# stage makes. Your functions may use `torch`, `nn`, `F` and `dist` besides their
# arguments; the next cell imports them and the checker.

# %%
import torch  # noqa: F401 - for the exercises' functions
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from torch import nn  # noqa: F401

from zerolearn import comm, exercises  # noqa: F401

# %% tags=["exercise"]
# exercise: 07.stage_from_bytes

# %%
exercises.check("07.stage_from_bytes", stage_from_bytes)

# %% [markdown]
# All eight runs print the same losses: the same model, the same global batches, the same
# Adam. The bytes each rank holds tell which states each implementation shards on our
# 2 ranks: DDP holds everything (our stage 0); `ZeroRedundancyOptimizer` shards only the
# optimizer states (stage 1); FSDP2 shards parameters, gradients and optimizer states
# (stage 3). With `reshard_after_forward=False`, FSDP2 keeps a unit's parameters gathered
# from its forward to its backward, saving one all-gather per unit, but shards them again
# afterwards, so at rest it holds what stage 3 holds; ZeRO-2's full parameters have no
# exact counterpart in PyTorch.

# %%
ch07.states_figure(results)

# %% [markdown]
# The median step times of the same run (they change with the machine, and from run to
# run on a machine shared with other work):

# %% tags=["nbval-ignore-output"]
print(ch07.step_times_table(results))

# %% [markdown]
# ## Our stages in DeepSpeed and PyTorch
#
# DeepSpeed numbers its stages as we do (stage 0 is plain data parallelism). The config
# keys that give each of our engines, and the PyTorch API that shards the same states:

# %%
import json

for stage in range(4):
    print(f"stage {stage}: DeepSpeed {json.dumps(ch07.DEEPSPEED_CONFIG[stage])}")
    print(f"         PyTorch   {ch07.TORCH_EQUIVALENT[stage]}")

# %% [markdown]
# `reduce_bucket_size` is our `--bucket-mb` (in elements rather than MiB): the constant-size
# fused buffer of Sec 6.2. `overlap_comm` launches bucket reductions during backward, as our
# hooks do; `contiguous_gradients` copies gradients into one flat buffer, as our flat groups
# do (MD for gradients, Sec 6.3).
#
# DeepSpeed itself installs from the package registry as an optional extra
# (`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`, no compiled ops: ZeRO's
# stages do not need them) and runs on CPU with `DS_ACCELERATOR=cpu` under `torchrun`.
# `make deepspeed` installs it and runs `zerolearn.experiments.deepspeed_cpu` for stages 0-3
# on 2 gloo ranks: the same GPT, batches and Adam as above, under `deepspeed.initialize`
# with the configs just printed. Its results are stored in `notebooks/data/deepspeed_cpu.json`,
# so this chapter shows them whether or not DeepSpeed is installed here:

# %% tags=["nbval-ignore-output"]
print("DeepSpeed installed here:", importlib.util.find_spec("deepspeed") is not None)

# %%
stored = chapters.stored("deepspeed_cpu.json")
first = stored["deepspeed, stage 0"]
print(f"DeepSpeed {first['deepspeed']}, {first['world_size']} ranks\n")
print(ch07.deepspeed_table(results, stored))

# %% [markdown]
# The losses agree within $10^{-6}$ over all four steps at every stage. The bytes differ in one place:
# at stages 1 and 2 DeepSpeed keeps an fp32 copy of this rank's partition of the parameters
# beside the parameters themselves, even though they are already fp32 here (its ZeRO
# optimizer always steps on its own fp32 partition); we step on the parameters' own
# storage when they are fp32, so $K = 8$ holds exactly for fp32 Adam.
#
# One setting had to be written down to get there: `"gradient_clipping": 0.0`. From
# version 0.19.3 DeepSpeed clips the global gradient norm at 1.0 unless its config says
# otherwise (before, its default was 0.0, no clipping); with that default, the losses part
# from every other implementation's at the third step. When a port to
# DeepSpeed "trains a bit differently", compare the configs before the code.

# %% [markdown]
# ## A model you did not write: Hugging Face GPT-2 under ZeRO-3
#
# The engines wrap any `nn.Module`. Here is a tiny `GPT2LMHeadModel` (built from a config
# in code, nothing downloaded; `pip install .[hf]`) with its head tied to the token
# embedding, as GPT-2 ships. Its transformer blocks are the ZeRO-3 units, listed in
# forward order (prefetch follows that order). The embeddings, the final norm and the
# head are left to the root unit, which stays gathered for the whole forward and
# backward: the tied weight is read by the embedding first and by the head last, so it
# must stay gathered in between. (With the default units, the model's children, the
# engine puts a weight shared by two units into the root unit by itself.) Two ranks
# against one process on the whole batch:

# %%
hf = launch(ch07.hf_gpt2_zero3, 2)[0]
print(f"GPT2LMHeadModel: Psi = {hf['psi']:,} (tied weight counted once), {hf['units']} units")
print(f"params held per rank between steps: {hf['params_bytes']:,} bytes = "
      f"{hf['params_bytes'] / (4 * hf['psi']):.3f} x the fp32 model")
for step, (a, b) in enumerate(zip(hf["losses"], hf["reference_losses"], strict=True)):
    print(f"step {step}: ZeRO-3 on 2 ranks {a:.4f} | one process {b:.4f}")

# %% [markdown]
# ## Time and bytes beside the systems you would use
#
# `make bench` trains one GPT ($\Psi$ = 867,072, fp32 Adam, global batch 16 sequences of
# 64 bytes; larger than the book's so that a step lasts tens of milliseconds, long enough
# to time) on 4 gloo ranks under our four stages, torch DDP, DDP with
# `ZeroRedundancyOptimizer`, FSDP2 (`fully_shard` per block, with and without resharding
# after forward) and DeepSpeed's stages 0-3, and interleaves the systems in rounds so that
# the machine's drift hits all of them alike. For each system it reports the median and
# spread of the step time, whether the losses equal ours at every step (they must), and
# the bytes of parameters, gradients and optimizer states the busiest rank holds, measured
# from its tensors (FSDP2's DTensor shards, DeepSpeed's partitions). The run stored here
# comes from a machine of 2 CPU cores shared with other work; the spreads show how noisy
# its times are (`make bench QUICK=1` runs a smaller version in about 2 minutes). First
# the times, then the bytes the busiest rank holds:

# %%
from zerolearn import figures
from zerolearn.bench import results as bench_results

BENCH = chapters.stored("bench/bench.json")
print(ch07.bench_table(BENCH, "time"))

# %%
print(ch07.bench_table(BENCH, "bytes"))

# %% [markdown]
# The same run on a GPT 3x wider ($d_{model}$ 384, $\Psi$ = 7.3 million; its bytes are in
# the folded cell after it), and each of our stages against DDP on a single rank, where
# no communication hides the engine's own cost:

# %%
for wider in BENCH["more_widths"]:
    print(ch07.bench_table(wider, "time"))
print(bench_results.format_overhead(BENCH["overhead_ws1"]))

# %% tags=["hide-output"]
for wider in BENCH["more_widths"]:
    print(ch07.bench_table(wider, "bytes"))

# %% [markdown]
# **Bytes.** Every one of our stages holds exactly what Sec 5's formulas give in fp32: the
# paper accounts only mixed precision (2 + 2 + K, K = 12, Sec 3.1), and fp32 Adam's 4 + 4 + 8
# bytes per parameter is the book's adaptation. DeepSpeed's stages 1 and 2 keep a separate fp32 copy of
# their partition (12 $\Psi/N_d$ of optimizer state, where ours keeps 8) and extra
# gradient buffers; `ZeroRedundancyOptimizer` shards whole tensors, so its busiest rank
# holds more than an even shard.
#
# **Time**, at every system's default settings (ours: 25 MiB buckets on the CPU; ZeRO-3
# prefetches small units up to 4 MiB at a time). Our stages 1 and 2 are the fastest of
# their kind here at both widths. Stage 3 is ahead of DeepSpeed's and FSDP2's at both: at
# $d_{model}$ 128 its units are small, and one prefetch brings all the units after the
# embedding in one fused all_gather, where the paper's schedule (chapter 4,
# `prefetch_mb=0`) pays a collective per unit. Our stage 0 makes the same few all-reduces
# of the same buckets as DDP and DeepSpeed's stage 0 and lands level with them, within
# the spread.

# %% [markdown]
# ### On a GPU
#
# A CPU hides what a GPU shows: there the host only launches kernels, and any moment
# it spends in Python, or waiting for the device, leaves the GPU idle. `make bench GPU=1`
# runs the same comparison on NCCL, one rank per GPU, at $d_{model}$ 1024 (8 layers,
# 256 tokens, batch 16, $\Psi$ = 101.6 million) against torch's systems, and stores
# `notebooks/data/bench/gpu.json`. The run stored with the book, on one H200:

# %%
print(bench_results.format_summary(chapters.stored("bench/gpu.json")))

# %% [markdown]
# In that run (its line under the table gives the commit) every stage held 1.1 to 2.6 GiB
# less CUDA memory than its torch peer but took 9-13% longer per step. torch's profiler
# put the gap on the host: the GPU sat idle about 6 ms of a 66 ms step while the host
# read values back (`.item()`, a device-to-host copy, each a synchronization) and ran
# torch's Adam once per bucket, 26 calls per step at stage 3 where torch makes one
# multi-tensor call. The engine since reads nothing back inside `engine.backward` and
# `engine.step` (a test counts the reads: zero) and steps all of a rank's masters in one
# fused call on CUDA. On your GPU, `make bench GPU=1` measures it again and replaces the
# stored file.

# %% [markdown]
# Stage 0 leaves out no check to get there: a parameter no rank used must not be moved by
# momentum, and the reduced gradient, the same on every rank, already says which
# parameters some rank used, so the ranks exchange flags only in a step where some
# parameter's reduced gradient is all zeros. On gloo every collective pays a fixed
# start-up (the same start-up is why ZeRO-3's ranks compare notes only in debug mode:
# chapter 4). The bucket size trades on it: many small buckets pay the start-up many
# times, one large bucket cannot start before backward ends (chapter 3 measures what
# bucket size does to memory).
#
# The same harness sweeps the world size (1, 2, 4 ranks) and the model's width
# ($\Psi$ from 137 thousand to 1.7 million, 12.6x) for each stage; the measured bytes and
# traffic lie on the paper's lines (at Nd = 1 the ledger still counts the collectives'
# elements, though nothing leaves the rank):

# %%
SCALING = chapters.stored("bench/scaling.json")
print(ch07.scaling_table(SCALING))

# %%
figures.scaling_figure(SCALING)

# %% [markdown]
# ## Choosing a stage
#
# Use the lowest stage that fits: stages 1 and 2 move no more data than DP (Sec 7),
# stage 3 moves 1.5x (Sec 7.2.2). And budget for the residual states (activations,
# temporary buffers; Sec 3.2), which ZeRO-DP does not divide.
#
# ### Exercise 2 · the lowest stage for the GPUs you have
#
# Write `choose_stage(psi, device_bytes, nd, residual_bytes=0)`: the lowest stage whose
# model states (bf16 and Adam, K = 12) on `nd` GPUs plus `residual_bytes` per GPU fit in
# `device_bytes`, or None when no stage fits. The checker tries GPT-2 1.5B with and
# without its residual states at batch 32, a model whose residual states move the answer
# from stage 0 to stage 3, and models of 7B to 70B parameters on 40 and 80 GB GPUs,
# against `zerolearn.memory.model`.

# %% tags=["exercise"]
# exercise: 07.choose_stage

# %%
exercises.check("07.choose_stage", choose_stage)

# %% [markdown]
# The fit solver asks the other question, "what is the smallest setup that holds my
# model?", first for model states alone, then for GPT-2 1.5B with its residual states at
# batch 32 (checkpointed activations, one block's recomputation, DP's fused fp32 gradient
# buffer; Sec 3.2):

# %%
for psi, gb in ((1.5e9, 32), (7e9, 80), (13e9, 80), (70e9, 80)):
    fit = memory.smallest_fit(psi, gb * 1e9)
    print(f"{psi / 1e9:>5.1f}B params on {gb} GB GPUs: stage {fit.stage} on {fit.nd} GPUs, "
          f"{fit.bytes_per_device / 1e9:.1f} GB of model states each")
spec = memory.ActivationSpec(hidden=1600, layers=48, batch_per_gpu=32, seq_len=1024, checkpointing=True)
fit = memory.smallest_fit(memory.gpt_params(48, 1600), 32e9, activation=spec)
print(f"GPT-2 1.5B, batch 32, with residual states on 32 GB GPUs: stage {fit.stage} on {fit.nd} GPUs, "
      f"{fit.bytes_per_device / 1e9:.1f} GB each")

# %% [markdown]
# ## Three pitfalls, shown on our engines
#
# **Memory above the estimate.** Model states alone said DP for GPT-2 1.5B; its residual
# states at batch 32 say P_os on two GPUs. A real step holds activations, the fused
# buffers of backward and the allocator's fragmentation (chapter 0 and 5):
# `peak_bytes` in a training report is always above `model_state_bytes`. Budget for
# residual states before picking a stage.

# %% [markdown]
# **Stage 3 slow on small models.** Stage 3 gathers every unit twice per step, the third
# Psi of traffic (Sec 7.2.2), and here it is not hidden: in the benchmark, stage 3's
# median step is 114 ms against stage 2's 66 ms at $d_{model}$ 128, and 450 against
# 340 ms at 384. Our engine prefetches: it starts the next units' all_gather
# asynchronously before the current unit computes. On a GPU, NCCL runs that gather on
# its own CUDA stream beside the compute kernels, so it can hide behind a unit's compute
# when the compute takes longer. gloo on a CPU runs it on threads that share the cores
# the compute needs, so the two take turns and starting early saves little. On a GPU,
# small units still show: their compute is too short to cover a latency-bound gather.
# Stage 3 pays off when memory, not time, is the constraint.

# %% [markdown]
# **Hangs from ranks taking different code paths.** Collectives pair up by order. If one
# rank skips a unit's forward (a data-dependent branch, an early `return` on one rank), it
# issues one all-gather fewer, and the others wait forever, or, with a timeout, fail after
# it. Every process group here has a timeout, and a debug mode
# (`ZEROLEARN_DEBUG_COLLECTIVES=1`) compares what each rank is about to do before every
# collective and names the ranks that disagree.

# %% [markdown]
# ## Questions
#
# Write down a number for each question before you run the cell under it.
#
# **1.** How many Psi of traffic did each of our stages move per step in the first run
# of this chapter, by the ledger (Sec 7.2)?

# %%
for stage in range(4):
    print(f"stage {stage}: {results[f'ours, stage {stage}']['psi_per_step']:.3f} Psi per step")

# %% [markdown]
# **2.** DeepSpeed's stage 2 in the benchmark ($\Psi$ = 867,072, 4 ranks, fp32 Adam): how
# many bytes of optimizer state does a rank hold, its fp32 copy of the partition
# included?

# %%
held = max(r["bytes"]["optimizer_states"] for r in BENCH["systems"]["deepspeed-2"]["ranks"])
print(f"deepspeed-2: {held:,} bytes of optimizer state per rank = {held / BENCH['psi']:.1f} Psi")

# %% [markdown]
# **3.** A 13B model on 40 GB GPUs, model states only: which stage, on how many GPUs, by
# the fit solver's rule (the fewest GPUs, then the lowest stage)?

# %%
fit = memory.smallest_fit(13e9, 40e9)
print(f"13B on 40 GB: stage {fit.stage} on {fit.nd} GPUs, {fit.bytes_per_device / 1e9:.1f} GB of model states each")

# %% [markdown]
# ## Summary
#
# - PyTorch's DDP, `ZeroRedundancyOptimizer` and FSDP2 compute the same losses as our
#   stages 0, 1 and 3, and shard the same states per rank (to a KiB:
#   `ZeroRedundancyOptimizer` partitions whole tensors, our engines flat padded shards).
# - DeepSpeed's `zero_optimization.stage` is the paper's stage; its bucket and contiguity
#   options are the paper's CB and MD.
# - Pick the lowest stage that fits; budget for residual memory; keep every rank on the
#   same code path, and use timeouts so that a bug fails instead of hanging.
