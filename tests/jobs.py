"""Functions the multi-rank tests run on spawned gloo ranks (importable by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.models import GPTConfig, build_model

GPT = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
LR = {"sgd": 0.1, "adam": 1e-2, "adamw": 1e-2}


def small_gpt(seed: int = 0) -> nn.Module:
    return build_model("gpt", seed, gpt=GPT)


def global_batch(step: int):
    return data.gpt_batch(step, BATCH, GPT.seq_len, seed=1)


def gpt_loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


class PartlyFrozen(nn.Module):
    """first is frozen; last only runs on odd steps (no gradient on even ones)."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(8, 8), nn.Linear(8, 7), nn.Linear(7, 7)
        self.first.requires_grad_(False)

    def forward(self, x, use_last: bool):
        x = self.middle(torch.relu(self.first(x)))
        return self.last(x) if use_last else x


def frozen_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 7, generator=g)


def frozen_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return PartlyFrozen()


def train_engine(stage: int, optimizer: str = "sgd", dtype: str = "fp32", steps: int = 4,
                 accum: int = 1, model: str = "gpt", bucket_mb: float = 0.01,
                 max_grad_norm: float | None = None) -> dict:
    """Train with our engine on this rank's slices; return losses, params, ledgers."""
    ctx = zdist.context()
    net = small_gpt() if model == "gpt" else frozen_model()
    engine = make_engine(stage, net, optimizer=optimizer, lr=LR[optimizer], dtype=dtype,
                         bucket_mb=bucket_mb, max_grad_norm=max_grad_norm)
    comm.LEDGER.reset()
    losses, grads_bytes = [], None
    for step in range(steps):
        x, y = global_batch(step) if model == "gpt" else frozen_batch(step)
        x, y = data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)
        local = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            if model == "gpt":
                loss = gpt_loss(engine(xm), ym)
            else:
                loss = F.mse_loss(engine(xm.to(engine.dtype), step % 2 == 1).float(), ym)
            engine.backward(loss / accum, sync=i == accum - 1)
            local += loss.item() / accum
        grads_bytes = engine.model_state_bytes()["grads"]
        engine.step()
        engine.zero_grad()
        losses.append(comm.monitor_mean(local))
    comm_per_step = comm.LEDGER.volume_elements() / steps
    ledger = comm.LEDGER.as_dict()
    working = {n: p.detach().clone() for n, p in net.named_parameters()} if stage < 3 else None
    held = engine.model_state_bytes()
    return {"losses": losses, "params": engine.full_state_dict(), "working": working,
            "bytes": {"params": held["params"], "grads": grads_bytes,
                      "optimizer_states": held["optimizer_states"]},
            "padding": engine.padding, "psi": engine.psi, "comm_per_step": comm_per_step,
            "ledger": ledger, "peak_grad_bytes": engine.peak_grad_bytes,
            "peak_gathered_bytes": getattr(engine, "peak_gathered_bytes", None),
            "group_bytes": [g.padded_numel * engine.dtype.itemsize for g in engine.groups],
            "unit_bytes": [sum(g.padded_numel for g in u.groups) * engine.dtype.itemsize
                           for u in engine.units] if stage == 3 else None}


def many(runs: list[dict]) -> list[dict]:
    """Several :func:`train_engine` runs in one process group (saves spawning)."""
    return [train_engine(**kw) for kw in runs]


def reference(optimizer: str = "sgd", steps: int = 4, model: str = "gpt",
              max_grad_norm: float | None = None) -> dict:
    """Single-process training in plain PyTorch on the whole global batch."""
    net = small_gpt() if model == "gpt" else frozen_model()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer](
        params, lr=LR[optimizer])
    losses = []
    for step in range(steps):
        if model == "gpt":
            x, y = global_batch(step)
            loss = gpt_loss(net(x), y)
        else:
            x, y = frozen_batch(step)
            loss = F.mse_loss(net(x, step % 2 == 1), y)
        opt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in net.named_parameters()
                                         if p.requires_grad}}


def torch_parity(steps: int = 4) -> dict:
    """Losses of torch's DDP, ZeroRedundancyOptimizer and FSDP2 on the same job (Adam)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerolearn import compat

    ctx = zdist.context()
    out = {}
    for kind in ("ddp", "zero_redundancy", "fsdp2"):
        net = small_gpt()
        if kind == "fsdp2":
            fully_shard = compat.fully_shard()
            for unit in net.units():
                fully_shard(unit)
            wrapped = fully_shard(net)
            opt = torch.optim.Adam(net.parameters(), lr=LR["adam"])
        else:
            wrapped = DDP(net)
            opt = (torch.optim.Adam(net.parameters(), lr=LR["adam"]) if kind == "ddp" else
                   ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=LR["adam"]))
        losses = []
        for step in range(steps):
            x, y = global_batch(step)
            x, y = data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)
            loss = gpt_loss(wrapped(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(comm.monitor_mean(loss.item()))
        out[kind] = losses
    return out


def raise_on_rank(bad_rank: int) -> int:
    rank = zdist.context().rank
    if rank == bad_rank:
        raise ValueError(f"boom on purpose at rank {rank}")
    return rank


def whoami() -> tuple[int, int]:
    ctx = zdist.context()
    return ctx.rank, ctx.world_size


def train_all_stages(argv: list[str]) -> list[dict]:
    """The train CLI's report for stages 0-3 in one process group."""
    from zerolearn.train import train_job

    return [train_job(["--stage", str(s), *argv]) for s in range(4)]


def resume_round_trip(stage: int, steps: int = 4, split: int = 2) -> dict:
    """Train ``split`` steps, save state_dict, rebuild, load, finish; vs uninterrupted."""
    ctx = zdist.context()

    def run(engine, first, last):
        for step in range(first, last):
            x, y = global_batch(step)
            x, y = data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
            engine.zero_grad()

    whole = make_engine(stage, small_gpt(), optimizer="adam", lr=LR["adam"], bucket_mb=0.01)
    run(whole, 0, steps)
    first = make_engine(stage, small_gpt(), optimizer="adam", lr=LR["adam"], bucket_mb=0.01)
    run(first, 0, split)
    state = first.state_dict()
    second = make_engine(stage, small_gpt(seed=7), optimizer="adam", lr=LR["adam"], bucket_mb=0.01)
    second.load_state_dict(state)
    run(second, split, steps)
    return {"whole": whole.full_state_dict(), "resumed": second.full_state_dict()}
