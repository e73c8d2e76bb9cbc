"""Models nobody here wrote, and loops written the way their users write them, for
spawned gloo ranks: Hugging Face GPT-2 (tied and untied) and Llama tiny configs, a
BatchNorm CNN, hand-written weight tying, tensor parallelism with clipping and fp16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine

BATCH, SEQ, VOCAB = 12, 16, 256


def hf_model(kind: str) -> nn.Module:
    """A tiny Hugging Face model built from a config in code (nothing downloaded)."""
    import transformers

    torch.manual_seed(0)
    if kind in ("gpt2", "gpt2_untied"):
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      tie_word_embeddings=kind == "gpt2", attn_pdrop=0.0, embd_pdrop=0.0,
                                      resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


class HandTied(nn.Module):
    """Ties the head to the embedding by reading ``emb.weight`` in its own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = nn.Embedding(VOCAB, 16), nn.Linear(16, 16)

    def forward(self, x):
        return F.linear(torch.tanh(self.mix(self.emb(x))), self.emb.weight)


class BatchNormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


def build(kind: str) -> nn.Module:
    if kind == "cnn":
        return BatchNormCNN()
    if kind == "hand_tied":
        return HandTied()
    return hf_model(kind)


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "cnn":
        return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, x.roll(-1, dims=1)


def loss_of(kind: str, model: nn.Module, out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().flatten(0, -2) if kind != "cnn" else logits.float(), y.flatten())


def train(kind: str, stage: int | None, steps: int = 3, accum: int = 1, accum_style: str = "repeated") -> dict:
    """``stage`` None: plain PyTorch Adam on the whole batch in one process (the reference).
    Else the engine on this rank's slice. Returns losses, full fp32 parameters, buffers."""
    model = build(kind)
    if stage is None:
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(steps):
            x, y = batch(kind, step)
            opt.zero_grad()
            loss = loss_of(kind, model, model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    ctx = zdist.context()
    engine = make_engine(stage, model, optimizer="adam", lr=1e-2, bucket_mb=0.01)
    losses = []
    for step in range(steps):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(kind, step))
        local = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            loss = loss_of(kind, model, engine(xm), ym) / accum
            if accum_style == "no_sync" and i < accum - 1:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            local += loss.item()
        engine.step()
        engine.zero_grad()
        losses.append(comm.monitor_mean(local))
    if engine.broadcast_buffers:
        model.eval()  # a last forward syncs buffers, as the next step would (eval: no update after)
        engine(x[:1])
    return {"losses": losses, "params": engine.full_state_dict(),
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def train_ddp(kind: str, stage: None = None, steps: int = 3) -> dict:
    """torch's DistributedDataParallel (buffers broadcast from rank 0, its default) on
    this rank's slice: the reference for models whose forward depends on the local
    batch (BatchNorm normalizes with each rank's own batch statistics)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = zdist.context()
    model = build(kind)
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(kind, step))
        opt.zero_grad()
        loss = loss_of(kind, model, ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(comm.monitor_mean(loss.item()))
    model.eval()  # DDP broadcasts buffers at the start of a forward: sync them once more
    ddp(x[:1])
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def many(runs: list[dict]) -> list[dict | str]:
    """Several :func:`train` runs in one process group; an exception becomes its message."""
    out = []
    for kw in runs:
        try:
            out.append(train_ddp(**kw) if kw.pop("ddp", False) else train(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out
