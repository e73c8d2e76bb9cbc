"""Chapter 7, in practice: our stages beside torch's DDP, ZeroRedundancyOptimizer and FSDP2.

``side_by_side`` trains the same GPT on the same global batches with each
implementation on the current process group and returns, per implementation, the
losses, the model-state bytes this rank holds (counted from its tensors: local shards
of DTensors, the optimizer's local state) and the median step time. The DeepSpeed
config keys that correspond to our stages are in ``DEEPSPEED_CONFIG``.

The chapter's exercises (``07.stage_from_bytes``, ``07.choose_stage``) are beside this
module, in :mod:`zerolearn.chapters.ch07`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from zerolearn import comm, compat, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.models import GPTConfig, build_model
from zerolearn.train import step_engine

GPT = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
BATCH, LR = 8, 1e-3

# Our stage -> the DeepSpeed config that does the same thing (DeepSpeed's docs, "ZeRO").
DEEPSPEED_CONFIG = {
    0: {"zero_optimization": {"stage": 0}},
    1: {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}},
    2: {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True,
                              "contiguous_gradients": True}},
    3: {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                              "stage3_param_persistence_threshold": 0}},
}
# Our stage -> the PyTorch API that shards the same states.
TORCH_EQUIVALENT = {0: "DistributedDataParallel", 1: "ZeroRedundancyOptimizer (+ DDP)",
                    2: "no exact match; closest: fully_shard(reshard_after_forward=False), which keeps "
                       "parameters gathered from forward to backward but shards them at rest",
                    3: "fully_shard (FSDP2, FULL_SHARD)"}


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.untyped_storage().data_ptr() not in seen and t.numel() > 1:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(opt) -> list:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local one in .optim
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]


def _batch(step: int):
    ctx = zdist.context()
    x, y = data.gpt_batch(step, BATCH, GPT.seq_len)
    return data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)


def _loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _run_torch(kind: str, steps: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = build_model("gpt", 0, gpt=GPT)
    if kind.startswith("fsdp2"):
        fully_shard = compat.fully_shard()
        for unit in net.units():
            fully_shard(unit, reshard_after_forward=kind == "fsdp2")
        wrapped = fully_shard(net, reshard_after_forward=kind == "fsdp2")
        opt = torch.optim.Adam(net.parameters(), lr=LR)
    else:
        wrapped = DDP(net)
        opt = (torch.optim.Adam(net.parameters(), lr=LR) if kind == "ddp" else
               ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=LR))
    losses, times, grads = [], [], 0
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = _batch(step)
        loss = _loss(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        grads = _local_bytes(p.grad for p in net.parameters())
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(comm.monitor_mean(loss.item()))
    return {"losses": losses, "step_s": statistics.median(times),
            "bytes": {"params": _local_bytes(net.parameters()), "grads": grads,
                      "optimizer_states": _local_bytes(_optimizer_tensors(opt))}}


def hf_gpt2_zero3(steps: int = 3) -> dict:
    """A Hugging Face ``GPT2LMHeadModel`` (tiny config built in code: vocabulary 256,
    2 layers, d 64, tied embeddings, no dropout) under ZeRO-3 on this process group,
    each of its transformer blocks a unit, and the same model in one process on the
    whole batch.

    Returns ``losses`` and ``reference_losses`` (global mean per step), ``psi``
    (trainable parameters, the tied weight counted once), ``params_bytes`` (working
    parameter bytes this rank holds between steps) and ``units`` (how many).
    Raises ImportError when transformers is not installed (``pip install .[hf]``).
    """
    import transformers

    def build():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=GPT.seq_len, n_embd=64, n_layer=2, n_head=4,
                                      attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)

    ref_model = build()
    opt = torch.optim.Adam(ref_model.parameters(), lr=LR)
    reference = []
    for step in range(steps):
        x, y = data.gpt_batch(step, BATCH, GPT.seq_len)
        opt.zero_grad()
        loss = _loss(ref_model(x).logits, y)
        loss.backward()
        opt.step()
        reference.append(loss.item())
    model = build()
    # Units in forward order. The embeddings, the final norm and the tied head stay in
    # the root unit, gathered for the whole forward and backward: the head reads the
    # token embedding's weight long after the embedding's own forward has returned.
    engine = make_engine(3, model, optimizer="adam", lr=LR, units=list(model.transformer.h), bucket_mb=4.0)
    losses = []
    for step in range(steps):
        local, _ = step_engine(engine, [_batch(step)], lambda out, y: _loss(out.logits, y))
        losses.append(comm.monitor_mean(local))
    return {"losses": losses, "reference_losses": reference, "psi": engine.psi,
            "params_bytes": engine.model_state_bytes()["params"], "units": len(engine.units)}


def side_by_side(steps: int = 4) -> dict[str, dict]:
    """Every implementation on this process group: {name: {losses, bytes, step_s}}."""
    out = {}
    for stage in range(4):
        comm.LEDGER.reset()
        engine = make_engine(stage, build_model("gpt", 0, gpt=GPT), optimizer="adam", lr=LR, bucket_mb=0.25)
        losses, times, grads = [], [], 0
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = _batch(step)
            loss = _loss(engine(x), y)
            engine.backward(loss)
            grads = engine.model_state_bytes()["grads"]
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(comm.monitor_mean(loss.item()))
        held = engine.model_state_bytes()
        out[f"ours, stage {stage}"] = {
            "losses": losses, "step_s": statistics.median(times),
            "psi_per_step": comm.LEDGER.volume_elements() / steps / engine.psi,
            "bytes": {"params": held["params"], "grads": grads, "optimizer_states": held["optimizer_states"]}}
    for kind, name in (("ddp", "torch DDP"), ("zero", "torch ZeroRedundancyOptimizer"),
                       ("fsdp2_grad_op", "torch FSDP2, no reshard"), ("fsdp2", "torch FSDP2")):
        out[name] = _run_torch(kind, steps)
    return out
