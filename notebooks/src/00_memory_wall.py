# %% [markdown]
# # Chapter 0 · The memory wall
#
# A GPT-2 with 1.5 billion parameters stores its weights in 3 GB at 16-bit precision, a tenth of a
# 32 GB V100. Yet the ZeRO paper reports that PyTorch or TensorFlow cannot train it on one such
# GPU (Sec 3), and that PyTorch's data parallelism runs out of memory at about 1.4B parameters on
# 32 GB devices (Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models*, SC'20, arXiv 1910.02054; Sec 1 and Sec 10.4). Before removing memory, we have
# to know where it goes. The paper's Sec 3 splits it in two:
#
# * **model states** (Sec 3.1): the parameters, their gradients and the optimizer's states;
# * **residual states** (Sec 3.2): activations, temporary buffers and fragmentation.
#
# This chapter measures both on a real GPT and puts every measurement beside the paper's formula.
# Section 4 adds them up for the paper's example: at its batch of 32 sequences of 1K tokens, the
# 24 GB of model states plus the residual states exceed 32 GB, with activation checkpointing too.

# %% [markdown]
# **Learning goals.** After this chapter you can
#
# 1. count the bytes of parameters, gradients and Adam's states from real tensors, and derive the
#    paper's 16 Ψ bytes for mixed-precision Adam: 2 + 2 + K with K = 12 (Sec 3.1);
# 2. explain why fp32 training costs the same 16 Ψ, and how K changes with the optimizer;
# 3. measure a transformer's activations with the memory ledger, with and without activation
#    checkpointing, and compare them with the paper's 12 · h · b · s · L values (Sec 3.2);
# 4. reproduce the paper's GPT-2 1.5B example: 24 GB of model states, about 60 GB of activations
#    at sequence length 1K and batch 32, and the 6 GB an fp32 buffer fusing all its gradients
#    can take (Sec 3.1, Sec 3.2).
#
# Notation, fixed for the whole book: `psi` (Ψ) is the number of trainable parameters, `k` (K) the
# optimizer's bytes per parameter, `nd` (N<sub>d</sub>) the data-parallel degree, `nm` (N<sub>m</sub>)
# the model-parallel degree. Sizes in GB are decimal (10<sup>9</sup> bytes, the paper's
# convention); KiB are 1024 bytes.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from zerolearn import data
from zerolearn.chapters.ch00 import lesson as ch00
from zerolearn.config import TrainConfig
from zerolearn.dist import launch
from zerolearn.memory import model as analytic
from zerolearn.memory.fit import gpt_params
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.models import GPTConfig, build_model
from zerolearn.tables import text_table

GB = analytic.GB  # 10**9 bytes, as in the paper

# %% [markdown]
# ## 1. Model states, counted from tensors
#
# Our model is the book's small GPT over bytes (vocabulary 256): width h = 32, two transformer
# blocks of two heads, context 16 bytes; chapters 1 to 4 train the same one. Each block has
# 12 h² + 13 h parameters (attention 4 h² + 4 h, the MLP 8 h² + 5 h, two LayerNorms 4 h), the
# formula `gpt_params` also uses for the paper's models.

# %%
from zerolearn.exercises.helpers import GPT as cfg  # GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)

model = build_model("gpt", seed=0, gpt=cfg)
psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"psi, counted from the tensors:        {psi:,} parameters")
print(f"psi, from 12 h^2 + 13 h per block etc: "
      f"{gpt_params(2, 32, vocab=256, seq_len=16, tied_embeddings=False):,} parameters")

# %% [markdown]
# Now one training step in plain PyTorch, fp32, with Adam. After `step()` three kinds of tensor
# exist: the parameters, their gradients (`p.grad`), and Adam's two running averages per parameter
# (`exp_avg`, the momentum, and `exp_avg_sq`, the variance). We add up their bytes.

# %%
x, y = data.gpt_batch(0, batch_size=8, seq_len=cfg.seq_len)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
opt.step()


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


counted = {
    "params": [p for p in model.parameters()],
    "grads": [p.grad for p in model.parameters()],
    "optimizer states": [s[name] for s in opt.state.values() for name in ("exp_avg", "exp_avg_sq")],
}
rows = [[name, f"{nbytes(t) / 1024:.1f}", f"{nbytes(t) / psi:.1f}"] for name, t in counted.items()]
total = sum(nbytes(t) for t in counted.values())
rows.append(["total", f"{total / 1024:.1f}", f"{total / psi:.1f}"])
print(text_table(["fp32 Adam", "KiB", "bytes per parameter"], rows, align=["left", "right", "right"]))

# %% [markdown]
# Four bytes of parameter, four of gradient, eight of optimizer state: **16 bytes per parameter**,
# and K = 8 for fp32 Adam.
#
# **Mixed precision** (Sec 3.1) runs forward and backward in fp16, so parameters and gradients
# take 2 Ψ + 2 Ψ bytes. (The paper speaks of fp16; the book also runs bf16, another 2-byte
# format, which takes the same bytes.) The optimizer must still update in fp32, or
# small updates vanish in rounding: it keeps an fp32 *master* copy of the parameters (4 Ψ) beside
# the fp32 momentum and variance (4 Ψ + 4 Ψ). The paper counts the master copy in the optimizer
# states: K = 12, and in total
#
# $$(2 + 2 + K)\,\Psi = 16\,\Psi \text{ bytes}.$$
#
# Mixed precision does not shrink model states at all; it saves activation memory and makes the
# arithmetic faster. K depends on the optimizer and the dtype: Exercise 1 asks you for it for SGD,
# with and without momentum, as well as for Adam.

# %% [markdown]
# Let us measure this with the book's engine instead of by hand. `train_all` runs the training
# loop (`zerolearn.train.train`, what `python -m zerolearn.train` runs) once per `TrainConfig`, on
# one spawned gloo rank (a separate process; gloo is PyTorch's backend for collectives on CPUs, and
# chapter 1 introduces ranks), and returns its JSON reports. Each report holds the bytes the rank
# *holds* per category, measured from the tensors themselves (a storage shared by two roles is
# counted once: in fp32 the working parameters *are* the master copy), and the paper's formula
# for the same run.

# %%
from zerolearn.train import train


def train_all(configs):
    """The training report of each configuration, in order: one launch serves several runs."""
    return [train(config) for config in configs]


# %%
common = TrainConfig(model="gpt", d_model=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head, seq_len=cfg.seq_len,
                     global_batch_size=8, steps=2, bucket_mb=0.25)
runs = {  # label: (dtype, optimizer, SGD momentum)
    "fp32 Adam": ("fp32", "adam", 0.0),
    "bf16 Adam": ("bf16", "adam", 0.0),
    "fp16 Adam": ("fp16", "adam", 0.0),
    "fp32 SGD+mom": ("fp32", "sgd", 0.9),
    "fp32 SGD": ("fp32", "sgd", 0.0),
}
configs = [common.replace(dtype=d, optimizer=o, momentum=m) for d, o, m in runs.values()]
reports = dict(zip(runs, launch(train_all, 1, configs)[0], strict=True))  # [0]: rank 0's results

# %%
cats = ("params", "grads", "optimizer_states")
rows, exact = [], True
for label, r in reports.items():
    held, formula = r["ranks"][0]["model_state_bytes"], r["analytic"]["model_state_bytes"]
    dtype, optimizer, momentum = runs[label]
    k = analytic.optimizer_k(optimizer, dtype, momentum=momentum > 0)
    rows.append([label, *(f"{held[c] / psi:.2f}" for c in cats), f"{sum(held.values()) / psi:.2f}",
                 f"{sum(formula.values()) / psi:.2f}", k])
    exact = exact and all(held[c] == formula[c] for c in cats)
print(f"bytes per parameter held by rank 0 (psi = {psi:,}), measured; formula: (2 + 2 + K)\n")
print(text_table(["run", "params", "grads", "optim. states", "total", "formula", "K"], rows,
                 align=["left", *["right"] * 6]))
print(f"\nmeasured == formula in every category of every run: {exact}")

# %% [markdown]
# Measured equals formula in every category: nothing here is padded (padding appears in section 5 and
# chapter 2, when states are split into N<sub>d</sub> equal shards), and each storage is counted once. Both
# fp32 and mixed-precision Adam hold 16 bytes per parameter. Scaled up, 16 Ψ is the wall: a 7.5B
# model needs 120 GB of model states (Fig 1), four V100s' worth, before a single activation.
#
# ### One step, event by event
#
# The memory ledger (`zerolearn.memory.ledger.MemoryLedger`) watches every tensor an operator
# creates, assigns it a category when it appears and follows it until its storage is freed.
# `watched_step` runs one training step through the engine under the ledger, phase by phase:

# %%
from zerolearn.engines import make_engine


def watched_step(engine, x, y):
    """One training step of `engine` on x, y, every allocation recorded; returns the ledger."""
    with MemoryLedger() as ledger:
        ledger.track_engine(engine)  # the engine's model states, by category
        with ledger.phase("forward"):
            loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        with ledger.phase("backward"):
            engine.backward(loss)
            del loss
        with ledger.phase("step"):
            engine.step()
            engine.zero_grad()
    return ledger


# %% [markdown]
# `step_timeline` runs two bf16 Adam steps of the same GPT on one spawned rank and watches the
# second (after the first, Adam's moments exist, as in any later step). Model states sit at the
# bottom for the whole step; gradients appear during backward and go at `zero_grad()`;
# activations rise during forward and are released as backward consumes them; temporaries
# (activation gradients, casting and communication buffers) come and go.

# %%
def step_timeline(dtype, optimizer, batch=8):
    engine = make_engine(0, build_model("gpt", 0, gpt=cfg), optimizer=optimizer, dtype=dtype, bucket_mb=4.0)
    x, y = data.gpt_batch(0, batch, cfg.seq_len)
    engine.backward(F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten()))
    engine.step()  # the first step, unwatched
    engine.zero_grad()
    x, y = data.gpt_batch(1, batch, cfg.seq_len)  # before the ledger starts: it sees the step only
    ledger = watched_step(engine, x, y)
    return {"timeline": [[e.index, e.phase, e.total, e.by_category] for e in ledger.timeline],
            "peak_bytes": ledger.peak, "peak_by_category": dict(ledger.peak_by_category)}


# %%
watched = launch(step_timeline, 1, dtype="bf16", optimizer="adam")[0]
ch00.step_timeline_figure(watched["timeline"],  # events: [index, phase, total bytes, bytes by category]
                          f"Memory of one bf16 Adam step, GPT with psi = {psi:,} (measured by the ledger)")
plt.show()
rows = [[c, f"{nb / 1024:.1f}"] for c, nb in watched["peak_by_category"].items()]
rows.append(["total", f"{watched['peak_bytes'] / 1024:,.1f}"])
print(text_table(["held at the peak", "KiB"], rows, align=["left", "right"]))

# %% [markdown]
# For this tiny model, activations and temporaries are as large as the model states. For
# billion-parameter models, model states dominate (Sec 3.1), which is why ZeRO attacks them
# first; but activations grow with batch and sequence length, as section 2 shows.
#
# ### Exercise 1: the model states of one replica
#
# Write `model_state_bytes(psi, optimizer, dtype)`: the bytes of parameters, gradients and
# optimizer states that one data-parallel replica of a model with `psi` parameters holds, by the
# paper's accounting (Sec 3.1). `optimizer` is `"adam"` (momentum and variance), `"sgd_momentum"`
# (one momentum buffer) or `"sgd"` (no state); `dtype` is the working dtype of parameters and
# gradients, `"fp32"`, `"bf16"` or `"fp16"`. Return `{"params": ..., "grads": ...,
# "optimizer_states": ...}` in bytes, ints. Remember what mixed precision adds to the optimizer's
# own buffers, and what it does not need in fp32.
#
# `exercises.check` calls your function for every optimizer and dtype at three model sizes (our
# GPT, 1.5B and 7.5B parameters), compares each entry with `zerolearn.memory.model`, and names the
# first entry that differs and what it should count. Your functions may use `torch`, `nn`, `F`,
# `dist` and `comm` besides their arguments; the next cell imports them and the checker.

# %%
import torch.distributed as dist  # noqa: F401 - for the exercises' functions
from torch import nn  # noqa: F401

from zerolearn import comm, exercises  # noqa: F401

# %% tags=["exercise"]
# exercise: 00.model_state_bytes

# %%
exercises.check("00.model_state_bytes", model_state_bytes)

# %% [markdown]
# ## 2. Residual states: activations
#
# Backward needs the inputs of every operation of forward: autograd *saves* them. These
# activations scale with batch size b, sequence length s, hidden width h and depth L. The paper
# estimates about 12 · h · b · s · L values for a GPT-2-like model (Sec 3.2). **Activation
# checkpointing** keeps only each block's input (b · s · h values per block) and recomputes the
# rest of the block during backward, for about 33% more compute (Sec 3.2).
#
# `measure_activations` runs one forward pass under the memory ledger and reports what is
# still held when forward ends. The parameters are registered first, so that views of weights
# (a transposed matrix) are not mistaken for new tensors.

# %%
from zerolearn.residual.checkpointing import CheckpointStore


def measure_activations(n_layer, batch, seq_len, d_model=64, checkpointing=False):
    """Bytes of activations our fp32 GPT holds between forward and backward (Sec 3.2)."""
    model = build_model("gpt", 0, gpt=GPTConfig(seq_len=seq_len, n_layer=n_layer, n_head=4, d_model=d_model))
    if checkpointing:
        model.checkpoint_store = CheckpointStore()  # each block keeps its input, recomputes the rest
    x, _ = data.gpt_batch(0, batch, seq_len)
    with MemoryLedger(record_timeline=False) as ledger:
        ledger.track(model.parameters(), "params")
        with ledger.phase("forward"):
            logits = model(x)
        held = ledger.live["activations"]  # made in forward, still alive: saved for backward, and the logits
    del logits
    return held

# %% [markdown]
# We measure GPTs of 1, 2 and 4 blocks, fp32 (4 bytes per value), b = 8, s = 64, h = 64: wider
# and longer than the book's GPT, so that the blocks' share stands well above the rest. The
# embedding output and the logits (b · s · 256 values) do not grow with depth, so the cost *per
# block* is the slope: the difference between 4 blocks and 1 block, divided by 3.

# %%
b, s, h = 8, 64, 64
layers = (1, 2, 4)
measured = {ckpt: [measure_activations(L, b, s, h, checkpointing=ckpt) for L in layers]
            for ckpt in (False, True)}
print(f"activations after forward, fp32, b={b}, s={s}, h={h} (KiB)\n")
print(text_table(["blocks L", "no checkpointing", "checkpointing"],
                 [[L, *(f"{measured[c][i] / 1024:,.1f}" for c in (False, True))] for i, L in enumerate(layers)]))
rows = []
for ckpt, name in ((False, "no checkpointing"), (True, "checkpointing")):
    slope = (measured[ckpt][2] - measured[ckpt][0]) / (layers[2] - layers[0])
    formula = analytic.activation_bytes(h, b, s, layers=1, bytes_per_value=4, checkpointing=ckpt)
    rows.append([name, f"{slope / 1024:,.1f}", f"{formula / 1024:,.1f}", f"{slope / formula:.3f}",
                 f"{slope / (4 * b * s * h):.3f}"])
print("\nper block (the slope)\n" + text_table(["", "measured KiB", "formula KiB", "ratio", "values per b*s*h"], rows,
                                              align=["left", *["right"] * 4]))

# %% [markdown]
# With checkpointing the measurement equals the formula: one b · s · h tensor per block. Without
# it, our block keeps about 16 values per b · s · h, a third more than the paper's 12. The paper's
# factor is a rough estimate for GPT-2-like models; the exact number depends on which tensors an
# implementation keeps. Ours, listed by walking autograd's graph of one block:

# %%
block = build_model("gpt", 0, gpt=GPTConfig(seq_len=s, n_layer=1, n_head=4, d_model=h)).blocks[0]
xb = torch.randn(b, s, h, requires_grad=True)
unit = 4 * b * s * h  # bytes of one fp32 b*s*h tensor
rows = [["the block input (LayerNorm 1 keeps it)", (b, s, h), 1.0]]
for r in ch00.block_saved_tensors(block, xb):
    by = ", ".join(r["saved_by"]).replace("ScaledDotProductFlashAttentionForCpu", "SDPA")
    rows.append([by, r["shape"], r["bytes"] / unit])
values_per_bsh = sum(v for *_, v in rows)
rows = [[by, str(shape), f"{v:.3f}"] for by, shape, v in rows] + [["total", "", f"{values_per_bsh:.3f}"]]
print(text_table(["saved for backward by (SDPA: scaled_dot_product_attention)", "shape", "x b*s*h"], rows,
                 align=["left", "left", "right"]))

# %% [markdown]
# Read top to bottom, in forward order: each LayerNorm keeps a mean and a 1/std per token
# (`result1`, `result2`); the fused q, k, v projection (`Addmm`) keeps its input, the first
# LayerNorm's output; attention keeps q, k and v (three views of the projection's one output, 3
# b · s · h), a log-sum-exp per row and its output, which the output projection keeps too; the
# second LayerNorm keeps the residual stream; the MLP keeps the LayerNorm output (1), the GELU's
# input (4, width 4h) and the GELU's output (4).
#
# CPU attention here is a fused kernel that keeps no s × s attention matrix; an implementation
# that keeps it adds values that grow with s². Whatever the constant, activations are linear in
# b, s, h and L: a batch or a context twice as large doubles them, while model states stay put.

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for ckpt, name, factor in ((False, "no checkpointing", 12), (True, "checkpointing", 1)):
    line, = ax.plot(layers, [m / 1024 for m in measured[ckpt]], "o-", label=f"measured, {name}")
    ax.plot(layers, [analytic.activation_bytes(h, b, s, L, 4, ckpt) / 1024 for L in layers], "--",
            color=line.get_color(), label=f"paper, {factor} h·b·s·L values")
ax.set_xlabel("transformer blocks L")
ax.set_ylabel("activation memory after forward (KiB)")
ax.set_title(f"Activations of our GPT, fp32, b={b}, s={s}, h={h}")
ax.set_xticks(layers)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The measured lines lie above the formula lines by the constant part (embedding output, final
# LayerNorm, logits) and, without checkpointing, by the steeper slope of 16 instead of 12 values.
#
# ## 3. Residual states: temporary buffers and fragmentation
#
# **Temporary buffers** (Sec 3.2). Communication libraries move one large buffer faster than many
# small ones, so operations such as the gradient all-reduce tend to fuse all gradients into one
# flat buffer, which can be fp32 (Sec 3.2; Sec 6.2 names Apex and Megatron). The paper's example:
# 6 GB for 1.5B parameters, growing with the model. PyTorch's DDP reduces bounded buckets instead
# (chapter 1); our engines fuse gradients into buckets of at most `--bucket-mb` MiB, ZeRO-R's fix
# (constant-size buffers, CB, Sec 6.2); the `temporary` category of the step above also holds
# activation gradients and casting buffers.
#
# **Fragmentation** (Sec 3.2 observes it; Sec 6.3 explains it). Short-lived tensors (recomputed
# activations, activation gradients) are interleaved with long-lived ones (checkpoints, parameter
# gradients). Free memory ends up in
# holes between long-lived tensors, and a large allocation can fail although the sum of the holes
# would hold it. ZeRO-R pre-allocates contiguous buffers for long-lived tensors (MD, Sec 6.3).
# Chapter 5 measures both.

# %%
print(f"Sec 3.2's fp32 fused buffer, 1.5B parameters: {analytic.fused_buffer_bytes(1.5e9, 4) / GB:.0f} GB")
print(f"capped at 256 MiB (CB):                       "
      f"{analytic.constant_buffer_bytes(1.5e9, cap_bytes=256 * 2**20) / GB:.2f} GB")
print(f"temporaries at the peak of our bf16 step:     "
      f"{watched['peak_by_category']['temporary'] / 1024:.1f} KiB")

# %% [markdown]
# ## 4. The paper's example: GPT-2 with 1.5B parameters
#
# Sec 3.1 takes GPT-2 with Ψ = 1.5B and mixed-precision Adam: at least 24 GB of model states,
# though the fp16 weights alone are 3 GB. Sec 3.2 adds the activations of the same model (48
# blocks, hidden 1600) at sequence length 1K and batch 32: about 60 GB, and about 8 GB with
# activation checkpointing. `zerolearn.memory` gives the same numbers from the same formulas.

# %%
psi_gpt2 = 1.5e9
states = analytic.model_state_bytes(psi_gpt2, nd=1, stage=0, k=12)  # 2 + 2 + K bytes per parameter
act = analytic.activation_bytes(hidden=1600, batch=32, seq_len=1024, layers=48)
act_ckpt = analytic.activation_bytes(hidden=1600, batch=32, seq_len=1024, layers=48, checkpointing=True)
print(f"GPT-2 1.5B: 48 blocks x hidden 1600 = {gpt_params(48, 1600) / 1e9:.2f}B parameters\n")
rows = [[f"model states: {name}", f"{states[name] / GB:.1f}"]
        for name in ("params", "grads", "optimizer_states", "total")]
rows += [["activations, seq 1K, batch 32 (12 h b s L values of 2 bytes)", f"{act / GB:.1f}"],
         ["  with checkpointing, one per block (the paper: about 8 GB)", f"{act_ckpt / GB:.1f}"],
         [f"  with our block's {values_per_bsh:.1f} values instead of 12", f"{act * values_per_bsh / 12 / GB:.1f}"]]
print(text_table(["GPT-2 1.5B, mixed-precision Adam", "GB"], rows, align=["left", "right"]))
print(f"\nlargest psi whose model states fit a 32 GB V100 under DP: "
      f"{analytic.max_model_params(analytic.V100_BYTES, nd=1, stage=0) / 1e9:.1f}B parameters")

# %% [markdown]
# The paper's "about 8 GB" with checkpointing is not derived from a formula (it cites square-root
# checkpointing); one checkpoint per block is 5.0 GB. Even with no activations at all, 16 Ψ on a
# 32 GB GPU stops at 2B parameters.
#
# Activations are not the only residual state. Backward recomputes one checkpointed block at a
# time, holding that block's 12 b · s · h values again, and in the paper's example an fp32 buffer
# fusing all gradients takes 4 Ψ = 6 GB (Sec 3.2; bounded buckets, as in DDP, take far less).
# `per_device_bytes` counts them all, that buffer at its full size, beside the model states, for
# one GPU at batch 32:

# %%
from zerolearn.memory.fit import ActivationSpec, per_device_bytes

budgets = {name: per_device_bytes(psi_gpt2, nd=1, stage=0, activation=ActivationSpec(
               hidden=1600, layers=48, batch_per_gpu=32, seq_len=1024, checkpointing=ckpt))
           for name, ckpt in (("no checkpointing", False), ("checkpointing", True))}
ch00.memory_bars_figure(budgets, analytic.V100_BYTES,
                        "GPT-2 1.5B, mixed-precision Adam, seq 1K, batch 32 (Sec 3.1, 3.2)")
plt.show()

# %% [markdown]
# Neither bar fits under the line: the 24 GB of model states leave 8 GB, and at the paper's batch
# of 32 the residual states need more, with checkpointing too. That makes the paper's claim (Sec 3)
# concrete at the setting of its Sec 3.2 activation example: plain data parallelism cannot train
# GPT-2 1.5B at batch 32 with sequences of 1K on one 32 GB GPU. (With Ψ = 1.5B, the paper's
# round figure; chapter 6 and the paper map count the 1.56B of 48 blocks of width 1,600.) A smaller
# batch would fit; the next exercise asks how small.

# %% [markdown]
# ### Exercise 2: how large a batch fits?
#
# Write `max_batch(psi, device_bytes, hidden, seq_len, layers, checkpointing=False)`: the largest
# batch b (sequences per step) that fits on one device beside the model states of
# mixed-precision Adam (16 bytes per parameter), with the paper's activations: 12 h · b · s · L
# values of 2 bytes, or h · b · s · L with one checkpoint per block (Sec 3.2). Leave out temporary
# buffers and fragmentation. Return an int, 0 when not even the model states fit; a batch that
# fills the device exactly fits.
#
# The checker tries GPT-2 1.5B on a 32 GB V100 (32 · 10<sup>9</sup> bytes) with and without
# checkpointing, a model that fills its device exactly, one whose model states alone are too
# large, and 7.5B parameters on a 141 GB device, against `zerolearn.memory.model`.

# %% tags=["exercise"]
# exercise: 00.max_batch

# %%
exercises.check("00.max_batch", max_batch)

# %% [markdown]
# Your `max_batch` counts model states and activations only, as the exercise asked: 4 sequences
# without checkpointing, 50 with it. The fused buffer and the recompute take some of that room;
# the third question at the end of the chapter counts how much.

# %% [markdown]
# ## 5. Ahead: who holds which slice
#
# Every data-parallel rank holds all 16 Ψ bytes. The paper's Fig 1 shows what ZeRO's three
# stages do about it; here it is drawn from the package's own flat buffers, on a toy model of
# Ψ = 26 parameters over N<sub>d</sub> = 3 ranks, bf16 with K = 12. Each row is one rank's
# parameters, gradients and optimizer states laid end to end; a solid slice is held, a faint
# one belongs to another rank. Look at how the solid area shrinks from row to row.

# %%
from zerolearn.figures import schematics

fig = schematics.model_states_figure(nd=3)
fig.suptitle("Who holds what (Fig 1): Nd = 3 ranks, 2 + 2 + K bytes per element, K = 12", fontsize=9)
fig

# %% [markdown]
# Padding makes 26 elements 27, so that each rank's shard is 9 elements. The bytes held
# are the formula's plus the padding's: one element of every buffer a rank holds whole,
# and a third of an element in every shard. Chapters 2 to 4 build each row and measure it.

# %%
layout = schematics.model_states(nd=3)
titles = ("DP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)", "ZeRO-3 (P_os+g+p)")
rows = [[titles[stage], held[0], f"{layout.formula_bytes[stage]['total']:.1f}"]
        for stage, held in layout.held_bytes.items()]
print(text_table(["stage", "held by each rank (bytes)", "formula (bytes)"], rows, align=["left", "right", "right"]))

# %% [markdown]
# ## Summary
#
# * Training memory is **model states** (parameters, gradients, optimizer states; Sec 3.1) plus
#   **residual states** (activations, temporary buffers, fragmentation; Sec 3.2).
# * Mixed-precision Adam holds (2 + 2 + K) Ψ = 16 Ψ bytes with K = 12 (fp32 master, momentum,
#   variance); fp32 Adam also holds 16 Ψ (4 + 4 + 8). Measured from a rank's tensors, both equal
#   the formula exactly.
# * Activations grow linearly with batch, sequence, width and depth: our block keeps about 16
#   b · s · h values, the paper estimates 12. Checkpointing keeps one b · s · h per block, at
#   about 33% more compute.
# * A buffer fusing all gradients grows with the model (Sec 3.2's example: 6 GB for 1.5B in fp32);
#   fragmentation can make an allocation fail with memory still free (chapter 5).
# * GPT-2 1.5B at seq 1K and batch 32: 24 GB of model states, 60 GB of activations (5 GB
#   checkpointed) and a 6 GB buffer do not fit a 32 GB GPU, with checkpointing or without.
#
# Data parallelism (chapter 1) adds GPUs but gives every one the full 16 Ψ: the wall stays.
# ZeRO's stages (chapters 2 to 4) remove that redundancy.

# %% [markdown]
# ## Questions
#
# Write your prediction down before you run each cell.
#
# **1.** Mixed precision with SGD and momentum (bf16 working copies): predict K and the bytes of
# model states per parameter, then compute them.

# %%
k_sgd = analytic.optimizer_k("sgd", "bf16", momentum=True)
per_param = analytic.model_state_bytes(psi, nd=1, stage=0, k=k_sgd)["total"] / psi
print(f"bf16 SGD with momentum: K = {k_sgd}, {per_param:.0f} bytes per parameter")

# %% [markdown]
# **2.** With checkpointing, how many KiB of activations does section 2's GPT (b = 8, s = 64,
# h = 64, fp32) gain from 4 blocks to 8? Predict from one b · s · h per block, then measure.

# %%
grown = measure_activations(8, b, s, h, checkpointing=True) - measured[True][layers.index(4)]
print(f"4 -> 8 blocks, checkpointed: +{grown / 1024:,.1f} KiB of activations")

# %% [markdown]
# **3.** Count the recompute and the 6 GB fused buffer too: how many sequences of 1K tokens per
# GPU now fit GPT-2 1.5B on 32 GB, without and with checkpointing? (`max_batch` said 4 and 50.)

# %%
from zerolearn.costmodel import max_batch_per_gpu  # every residual state counted, DP (stage 0) on one GPU

for ckpt in (False, True):
    batch = max_batch_per_gpu(psi_gpt2, analytic.V100_BYTES, 0, 1, hidden=1600, layers=48, seq_len=1024,
                              checkpointing=ckpt)
    print(f"checkpointing {ckpt!s:<5}: largest batch {batch}")

# %% [markdown]
# **4.** Model states only, 16 Ψ: predict the largest model that fits an 80 GB GPU under plain
# DP, and under ZeRO-3 (Ψ/N<sub>d</sub> each) with N<sub>d</sub> = 64.

# %%
for nd, stage in ((1, 0), (64, 3)):
    fits = analytic.max_model_params(80e9, nd=nd, stage=stage)
    print(f"80 GB, Nd = {nd:>2}, stage {stage}: {fits / 1e9:,.1f}B parameters")
