"""Jobs the nano-ZeRO tests run on spawned gloo ranks (importable by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.models import GPTConfig, build_model
from zerolearn.nano import NanoZero
from zerolearn.watch import watching

GPT = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
BATCH, STEPS, LR, WIDTH = 12, 3, 1e-3, 64


def _model(name: str):
    return build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=4) if name == "mlp" else build_model("gpt", 0, gpt=GPT)


def _batch(name: str, step: int):
    return data.mlp_batch(step, BATCH, WIDTH) if name == "mlp" else data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)


def _loss(name: str, out, y):
    return F.mse_loss(out, y) if name == "mlp" else F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def train(stage: int, model: str = "mlp", prefetch: bool = False, dtype: str = "fp32") -> dict:
    """STEPS Adam steps of NanoZero on this rank's slices: losses (mean over ranks), the
    parameters, bytes held (grads after backward), elements moved per step, psi and padding."""
    ctx = zdist.context()
    engine = NanoZero(_model(model), stage, LR, prefetch=prefetch, dtype=dtype)
    comm.LEDGER.reset()
    losses, grads = [], 0
    with watching():  # nano's parts call torch.distributed's collectives by name: the ledger watches them
        for step in range(STEPS):
            x, y = _batch(model, step)
            x, y = data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)
            loss = _loss(model, engine(x), y)
            engine.backward(loss)
            grads = engine.model_state_bytes()["grads"]
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
    moved = comm.LEDGER.volume_elements() / STEPS
    held = {**engine.model_state_bytes(), "grads": grads}
    losses = [comm.monitor_mean(v) for v in losses]
    return {"losses": losses, "params": engine.full_parameters(), "bytes": held, "moved": moved,
            "psi": engine.psi, "padding": engine.padding}


def many(runs: list[dict]) -> list[dict]:
    return [train(**kw) for kw in runs]


def reference(model: str = "mlp") -> dict:
    """One process, the whole global batch, fp32 torch Adam."""
    net = _model(model)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(model, step)
        loss = _loss(model, net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in net.named_parameters()}}
