"""The two models of the book: the seed experiment's MLP and a small byte-level GPT.

Both expose ``units()``: the modules ZeRO-3 gathers and frees one at a time
(Sec 5.3). For the GPT a unit is a transformer block, plus the embedding and the
output head; for the MLP a unit is one Linear layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn.dist import ConfigError

MODELS = ("mlp", "gpt")


class MLP(nn.Module):
    """A stack of square Linear layers with ReLU between them.

    The blog reproduction this book starts from (seed 002) trains 6 layers of width
    10,000 (100M parameters each) with Adam at batch 16; ``width=10_000`` gives that
    model, the default is scaled down to run in seconds on a CPU.

    Shapes: input and output (batch, width), float.
    """

    def __init__(self, width: int = 256, num_layers: int = 6):
        super().__init__()
        if width < 1 or num_layers < 1:
            raise ConfigError(f"MLP width={width}, num_layers={num_layers}: both must be >= 1")
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x

    def units(self) -> list[nn.Module]:
        return list(self.layers)


@dataclass
class GPTConfig:
    """Size of the GPT. ``vocab_size`` 256: one token per byte, no tokenizer."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64


class Embedding(nn.Module):
    """Token plus learned position embedding: (batch, seq) int64 -> (batch, seq, d_model)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Attention(nn.Module):
    """Causal multi-head self-attention; the q, k and v projections fused in one Linear."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to byte logits (not tied to the embedding,
    so each parameter belongs to exactly one ZeRO-3 unit)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class GPT(nn.Module):
    """A small GPT over bytes: (batch, seq) int64 -> logits (batch, seq, 256)."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        if cfg.d_model % cfg.n_head:
            raise ConfigError(f"GPT d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        # A residual.checkpointing.CheckpointStore turns on activation checkpointing: forward
        # then runs each block through its checkpoint() and reserve() (its MD pool).
        self.checkpoint_store = None
        for name, p in self.named_parameters():
            if p.dim() > 1:  # GPT-2's initialisation; LayerNorm and biases keep torch's
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        store = self.checkpoint_store if torch.is_grad_enabled() else None
        if store is not None:
            store.reserve(len(self.blocks), x)
        for block in self.blocks:
            # With a store, each block keeps only its input and recomputes in backward (Sec 3.2).
            x = store.checkpoint(block, x) if store is not None else block(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]


def build_model(name: str, seed: int = 0, *, mlp_width: int = 256, mlp_layers: int = 6,
                gpt: GPTConfig | None = None) -> nn.Module:
    """Build ``"mlp"`` or ``"gpt"`` with weights that depend only on ``seed``.

    Every rank calls this with the same seed, so every rank starts from the same
    parameters without a broadcast.

    Raises:
        ConfigError: unknown ``name``.
    """
    if name not in MODELS:
        raise ConfigError(f"--model {name!r}: allowed are {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(mlp_width, mlp_layers) if name == "mlp" else GPT(gpt)
