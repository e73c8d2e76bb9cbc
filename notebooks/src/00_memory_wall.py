# %% [markdown]
# # Chapter 0 · The memory wall
#
# A GPT-2 with 1.5 billion parameters stores its weights in 3 GB at 16-bit precision, a tenth of a
# 32 GB V100. Yet plain data parallelism cannot train it on such a GPU, and the ZeRO paper reports
# that PyTorch's data parallelism runs out of memory at about 1.4B parameters on 32 GB devices
# (Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*,
# SC'20, arXiv 1910.02054; Sec 1 and Sec 10.4). Before removing memory, we have to know where it
# goes. The paper's Sec 3 splits it in two:
#
# * **model states** (Sec 3.1): the parameters, their gradients and the optimizer's states;
# * **residual states** (Sec 3.2): activations, temporary buffers and fragmentation.
#
# This chapter measures both on a real GPT and puts every measurement beside the paper's formula.
#
# **Learning goals.** After this chapter you can
#
# 1. count the bytes of parameters, gradients and Adam's states from real tensors, and derive the
#    paper's 16 Ψ bytes for mixed-precision Adam: 2 + 2 + K with K = 12 (Sec 3.1);
# 2. explain why fp32 training costs the same 16 Ψ, and how K changes with the optimizer;
# 3. measure a transformer's activations with the memory ledger, with and without activation
#    checkpointing, and compare them with the paper's 12 · h · b · s · L values (Sec 3.2);
# 4. reproduce the paper's GPT-2 1.5B example: 24 GB of model states and about 60 GB of
#    activations at sequence length 1K and batch 32 (Sec 3.1, Sec 3.2).
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

GB = analytic.GB  # 10**9 bytes, as in the paper

# %% [markdown]
# ## 1. Model states, counted from tensors
#
# Our model is a small GPT over bytes (vocabulary 256): width h = 64, two transformer blocks,
# context 32 bytes. Each block has 12 h² + 13 h parameters (attention 4 h² + 4 h, the MLP
# 8 h² + 5 h, two LayerNorms 4 h), the formula `gpt_params` also uses for the paper's models.

# %%
cfg = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
model = build_model("gpt", seed=0, gpt=cfg)
psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"psi, counted from the tensors:        {psi:,} parameters")
print(f"psi, from 12 h^2 + 13 h per block etc: "
      f"{gpt_params(2, 64, vocab=256, seq_len=32, tied_embeddings=False):,} parameters")

# %% [markdown]
# Now one training step in plain PyTorch, fp32, with Adam. After `step()` three kinds of tensor
# exist: the parameters, their gradients (`p.grad`), and Adam's two running averages per parameter
# (`exp_avg`, the momentum, and `exp_avg_sq`, the variance). We add up their bytes.

# %%
x, y = data.gpt_batch(0, batch_size=8, seq_len=32)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
loss.backward()
opt.step()


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


counted = {
    "params": [p for p in model.parameters()],
    "grads": [p.grad for p in model.parameters()],
    "optimizer states": [s[name] for s in opt.state.values() for name in ("exp_avg", "exp_avg_sq")],
}
for name, tensors in counted.items():
    nb = nbytes(tensors)
    print(f"{name:<17} {nb / 1024:7.1f} KiB = {nb / psi:4.1f} bytes per parameter")
print(f"{'total':<17} {sum(nbytes(t) for t in counted.values()) / 1024:7.1f} KiB = "
      f"{sum(nbytes(t) for t in counted.values()) / psi:4.1f} bytes per parameter")

# %% [markdown]
# Four bytes of parameter, four of gradient, eight of optimizer state: **16 bytes per parameter**,
# and K = 8 for fp32 Adam.
#
# **Mixed precision** (Sec 3.1) runs forward and backward in a 2-byte format (fp16 or bf16), so
# parameters and gradients take 2 Ψ + 2 Ψ bytes. The optimizer must still update in fp32, or
# small updates vanish in rounding: it keeps an fp32 *master* copy of the parameters (4 Ψ) beside
# the fp32 momentum and variance (4 Ψ + 4 Ψ). The paper counts the master copy in the optimizer
# states: K = 12, and in total
#
# $$(2 + 2 + K)\,\Psi = 16\,\Psi \text{ bytes}.$$
#
# Mixed precision does not shrink model states at all; it saves activation memory and makes the
# arithmetic faster. K depends on the optimizer: SGD with momentum keeps one fp32 buffer, plain
# SGD none.
#
# Let us measure this with the book's engine instead of by hand. `train_all` runs the training
# loop (`zerolearn.train.train`, what `python -m zerolearn.train` runs) once per `TrainConfig`, on
# one spawned gloo rank, and returns its JSON reports. Each report holds the bytes the rank
# *holds* per category, measured from the tensors themselves (a storage shared by two roles is
# counted once: in fp32 the working parameters *are* the master copy), and the paper's formula
# for the same run.

# %%
from zerolearn.train import train


def train_all(configs):
    """The training report of each configuration, in order: one launch serves several runs."""
    return [train(config) for config in configs]


# %%
common = TrainConfig(model="gpt", d_model=64, n_layer=2, seq_len=32, global_batch_size=8, steps=2, bucket_mb=0.25)
runs = {  # label: (dtype, optimizer, SGD momentum)
    "fp32 Adam": ("fp32", "adam", 0.0),
    "bf16 Adam": ("bf16", "adam", 0.0),
    "fp16 Adam": ("fp16", "adam", 0.0),
    "fp32 SGD+mom": ("fp32", "sgd", 0.9),
    "fp32 SGD": ("fp32", "sgd", 0.0),
}
configs = [common.replace(dtype=d, optimizer=o, momentum=m) for d, o, m in runs.values()]
reports = dict(zip(runs, launch(train_all, 1, configs)[0]))  # [0]: rank 0's results

# %%
cats = ("params", "grads", "optimizer_states")
print(f"bytes per parameter held by rank 0 (psi = {psi:,}), measured | formula (2 + 2 + K) Psi\n")
print(f"{'run':<13} {'params':>13} {'grads':>13} {'optim states':>13} {'total':>13}   K")
for label, r in reports.items():
    held = r["ranks"][0]["model_state_bytes"]
    formula = r["analytic"]["model_state_bytes"]
    dtype, optimizer, momentum = runs[label]
    k = analytic.optimizer_k(optimizer, dtype, momentum=momentum > 0)
    cells = " ".join(f"{held[c] / psi:6.2f}|{formula[c] / psi:<6.2f}" for c in cats)
    total, total_f = sum(held.values()) / psi, sum(formula.values()) / psi
    print(f"{label:<13} {cells} {total:6.2f}|{total_f:<6.2f} {k:>3}")

# %% [markdown]
# Measured equals formula in every cell: nothing here is padded (padding appears in chapter 2,
# when states are split into N<sub>d</sub> equal shards), and each storage is counted once. Both
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
timeline = watched["timeline"]  # [index, phase, total bytes, bytes by category]
order = ("params", "optimizer_states", "grads", "activations", "temporary")
fig, ax = plt.subplots(figsize=(10, 4))
ax.stackplot([e[0] for e in timeline], [[e[3][c] / 1024 for e in timeline] for c in order],
             labels=order, step="post")
for phase in ("forward", "backward", "step"):
    start = next(e[0] for e in timeline if e[1] == phase)
    ax.axvline(start, color="k", lw=0.8, ls="--")
    ax.text(start + 1, ax.get_ylim()[1] * 0.95, phase, va="top")
ax.set_xlabel("allocation or free event within one training step (index)")
ax.set_ylabel("bytes held by rank 0 (KiB)")
ax.set_title(f"Memory of one bf16 Adam step, GPT with psi = {psi:,} (measured by the ledger)")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
fig.tight_layout()
plt.show()
print(f"peak: {watched['peak_bytes'] / 1024:,.1f} KiB, of which")
for c, nb in watched["peak_by_category"].items():
    print(f"  {c:<17} {nb / 1024:8.1f} KiB")

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
# We measure 1, 2 and 4 blocks, fp32 (4 bytes per value), b = 8, s = 64, h = 64. The embedding
# output and the logits (b · s · 256 values) do not grow with depth, so the cost *per block* is
# the slope: the difference between 4 blocks and 1 block, divided by 3.

# %%
b, s, h = 8, 64, 64
layers = (1, 2, 4)
measured = {ckpt: [measure_activations(L, b, s, h, checkpointing=ckpt) for L in layers]
            for ckpt in (False, True)}
print(f"activations after forward, fp32, b={b}, s={s}, h={h} (KiB)\n")
print(f"{'blocks L':>8} | {'no checkpointing':>16} | {'checkpointing':>13}")
for i, L in enumerate(layers):
    print(f"{L:>8} | {measured[False][i] / 1024:>16,.1f} | {measured[True][i] / 1024:>13,.1f}")

print(f"\nper block (slope, KiB)   {'measured':>9} {'formula':>9} {'ratio':>6}  values per b*s*h")
for ckpt, name in ((False, "no checkpointing"), (True, "checkpointing")):
    slope = (measured[ckpt][2] - measured[ckpt][0]) / (layers[2] - layers[0])
    formula = analytic.activation_bytes(h, b, s, layers=1, bytes_per_value=4, checkpointing=ckpt)
    print(f"{name:<24} {slope / 1024:>9,.1f} {formula / 1024:>9,.1f} {slope / formula:>6.3f}"
          f"  {slope / (4 * b * s * h):>6.3f}")

# %% [markdown]
# With checkpointing the measurement equals the formula: one b · s · h tensor per block. Without
# it, our block keeps about 16 values per b · s · h, a third more than the paper's 12. The paper's
# factor is a rough estimate for GPT-2-like models; the exact number depends on which tensors an
# implementation keeps. Ours, listed by walking autograd's graph of one block:

# %%
block = build_model("gpt", 0, gpt=GPTConfig(seq_len=s, n_layer=1, n_head=4, d_model=h)).blocks[0]
xb = torch.randn(b, s, h, requires_grad=True)
unit = 4 * b * s * h  # bytes of one fp32 b*s*h tensor
print(f"{'saved for backward by (SDPA: scaled_dot_product_attention)':<60} {'shape':<15} {'x b*s*h':>7}")
print(f"{'the block input (LayerNorm 1 keeps it)':<60} {str((b, s, h)):<15} {1:>7.3f}")
rows = ch00.block_saved_tensors(block, xb)
for r in rows:
    by = ", ".join(r["saved_by"]).replace("ScaledDotProductFlashAttentionForCpu", "SDPA")
    print(f"{by:<60} {str(r['shape']):<15} {r['bytes'] / unit:>7.3f}")
values_per_bsh = 1 + sum(r["bytes"] for r in rows) / unit
print(f"{'total':<76} {values_per_bsh:>7.3f}")

# %% [markdown]
# Read top to bottom, in forward order: each LayerNorm keeps a mean and a 1/std per token
# (`result1`, `result2`); the fused q, k, v projection (`Addmm`) keeps its input, the first
# LayerNorm's output; attention keeps q, k and v (three views of the projection's one output, 3
# b · s · h), a log-sum-exp per row and its output, which the output projection keeps too; the
# second LayerNorm keeps the residual stream; the MLP keeps the LayerNorm output (1), the GELU's
# input (4, width 4h) and the GELU's output (4). CPU attention here is a fused kernel that keeps no
# s × s attention matrix; an implementation that keeps it adds values that grow with s².
# Whatever the constant, activations are linear in b, s, h and L: a batch or a context twice as
# large doubles them, while model states stay put.

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
# small ones, so implementations fuse all gradients into one flat buffer before an all-reduce. For
# 1.5B parameters an fp32 fused buffer alone is 6 GB, and it grows with the model. Our engines
# fuse gradients into buckets of at most `--bucket-mb` MiB instead, which is ZeRO-R's fix
# (constant-size buffers, CB, Sec 6.2); the `temporary` category of the step above also holds
# activation gradients and casting buffers.
#
# **Fragmentation** (Sec 3.2). Short-lived tensors (recomputed activations, activation gradients)
# are interleaved with long-lived ones (checkpoints, parameter gradients). Free memory ends up in
# holes between long-lived tensors, and a large allocation can fail although the sum of the holes
# would hold it. ZeRO-R pre-allocates contiguous buffers for long-lived tensors (MD, Sec 6.3).
# Chapter 5 measures both.

# %%
print(f"fused fp32 gradient buffer, 1.5B parameters: {analytic.fused_buffer_bytes(1.5e9, 4) / GB:.0f} GB")
print(f"capped at 256 MiB (CB):                      "
      f"{analytic.constant_buffer_bytes(1.5e9, cap_bytes=256 * 2**20) / GB:.2f} GB")
print(f"temporaries at the peak of our bf16 step:    "
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
for name in ("params", "grads", "optimizer_states", "total"):
    print(f"model states, {name:<17} {states[name] / GB:6.1f} GB")
print(f"activations, seq 1K, batch 32    {act / GB:6.1f} GB  (12 h b s L values of 2 bytes)")
print(f"  with checkpointing, one/block  {act_ckpt / GB:6.1f} GB  (the paper: about 8 GB)")
print(f"  with our block's {values_per_bsh:.1f} values   {act * values_per_bsh / 12 / GB:6.1f} GB")
print(f"\nlargest psi whose model states fit a 32 GB V100 under DP: "
      f"{analytic.max_model_params(analytic.V100_BYTES, nd=1, stage=0) / 1e9:.1f}B parameters")

# %% [markdown]
# The paper's "about 8 GB" with checkpointing is not derived from a formula (it cites square-root
# checkpointing); one checkpoint per block is 5.0 GB, and recomputing one block during backward
# adds another 12 b · s · h values of that block on top. Even with no activations at all, 16 Ψ on a
# 32 GB GPU stops at 2B parameters; with activations and buffers, the paper's measured limit for
# PyTorch data parallelism is 1.4B.

# %%
parts = {"params (fp16)": states["params"], "grads (fp16)": states["grads"],
         "optimizer states (fp32)": states["optimizer_states"]}
scenarios = {"no checkpointing": act, "checkpointing": act_ckpt}
fig, ax = plt.subplots(figsize=(7, 4.5))
totals = []
for i, activations in enumerate(scenarios.values()):
    bottom = 0.0
    for j, (name, v) in enumerate({**parts, "activations (fp16)": activations}.items()):
        ax.bar(i, v / GB, bottom=bottom, color=f"C{j}", label=name if i == 0 else None)
        bottom += v / GB
    totals.append(bottom)
ax.axhline(analytic.V100_BYTES / GB, color="k", ls="--", lw=1)
ax.text(0.5, analytic.V100_BYTES / GB + 1, "one 32 GB V100", ha="center")
ax.set_xticks(range(len(scenarios)), [f"{k}\n{t:.1f} GB in all" for k, t in zip(scenarios, totals)])
ax.set_ylabel("memory per GPU (GB, 10^9 bytes)")
ax.set_title("GPT-2 1.5B, mixed-precision Adam, seq 1K, batch 32 (Sec 3.1, 3.2)")
ax.legend(fontsize=8, loc="upper right")
plt.show()

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
print(f"{'stage':<20} {'held by each rank':>17} {'formula':>9}")
for stage, held in layout.held_bytes.items():
    title = ("DP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)", "ZeRO-3 (P_os+g+p)")[stage]
    print(f"{title:<20} {held[0]:>15} B {layout.formula_bytes[stage]['total']:>7.1f} B")

# %% [markdown]
# ## Summary
#
# * Training memory is **model states** (parameters, gradients, optimizer states; Sec 3.1) plus
#   **residual states** (activations, temporary buffers, fragmentation; Sec 3.2).
# * Mixed-precision Adam holds (2 + 2 + K) Ψ = 16 Ψ bytes with K = 12 (fp32 master, momentum,
#   variance); fp32 Adam also holds 16 Ψ (4 + 4 + 8). We measured both from the tensors a rank
#   holds, and they equal the formula exactly.
# * Activations grow linearly with batch, sequence, width and depth. Our GPT block keeps about
#   16 b · s · h values against the paper's estimate of 12. Checkpointing cuts this to one b · s · h
#   per block, exactly as the formula says, at about 33% more compute.
# * Fused communication buffers grow with the model (6 GB for 1.5B in fp32); fragmentation can
#   make an allocation fail with memory still free. Chapter 5 treats both.
# * GPT-2 1.5B: 24 GB of model states and about 60 GB of activations at seq 1K, batch 32. That
#   does not fit a 32 GB GPU.
#
# Data parallelism, the subject of chapter 1, adds GPUs but gives every one of them the full
# 16 Ψ: the memory wall stays where it is. ZeRO's stages (chapters 2 to 4) remove that redundancy.
