"""Backwards at the seams of the engine's training state, for spawned gloo ranks: each
scenario trains a small model at a stage on this rank's slice of the batch (``stage=None``:
plain torch in one process on the whole batch, the reference) and returns its losses,
parameters and the collectives it booked, or the error it raised as ``"ConfigError: ..."``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine

BATCH, STEPS, LR, CLIP = 12, 3, 0.1, 0.05


class Net(nn.Module):
    """Three linear layers (ZeRO-3 units) and ``side``, used while ``use_side``;
    ``reentrant``: the head under torch's reentrant activation checkpoint."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.side = nn.Linear(8, 4)
        self.reentrant = reentrant
        self.use_side = True

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        if self.reentrant:  # the head first in backward, inside the checkpoint's own inner backward
            out = torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=True)
        else:
            out = self.head(h)
        return out + self.side(x) if self.use_side else out


def batch(step: int):
    g = torch.Generator().manual_seed(20 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def optimizer_of(params, name: str):
    if name == "adam":
        return torch.optim.Adam(params, lr=LR / 10)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(scenario: str, optimizer: str) -> dict:
    """Plain torch, one process, the whole batch."""
    model = Net(reentrant=scenario == "reentrant")
    opt = optimizer_of(model.parameters(), optimizer)
    losses = []
    for step in range(STEPS):
        model.use_side = (step == 0 or scenario != "zero_grad_keep") and scenario != "reentrant"
        x, y = batch(step)
        loss = F.mse_loss(model(x.requires_grad_(scenario == "input_grad")), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=scenario != "zero_grad_keep")
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _ops() -> dict[str, int]:
    return {op: s["calls"] for op, s in comm.LEDGER.as_dict().items() if s["calls"]}


def train(scenario: str, stage: int | None, optimizer: str = "sgd") -> dict:
    """``scenario`` at ``stage`` on this rank's slice (None: :func:`reference`)."""
    if stage is None:
        return reference(scenario, optimizer)
    ctx = zdist.context()
    model = Net(reentrant=scenario == "reentrant")
    kw = dict(lr=LR / 10) if optimizer == "adam" else dict(lr=LR, momentum=0.9)
    engine = make_engine(stage, model, optimizer=optimizer, bucket_mb=0.0005, **kw)
    out: dict = {"losses": [], "aside": [], "steps": [], "buckets": len(engine.buckets)}
    for step in range(STEPS):
        model.use_side = (step == 0 or scenario != "zero_grad_keep") and scenario != "reentrant"
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
        x.requires_grad_(scenario == "input_grad")
        comm.LEDGER.reset()
        forward = model if scenario == "reentrant" else engine  # model(x): the wrapped module called itself
        loss = F.mse_loss(forward(x), y)
        if scenario == "input_grad":  # a saliency map: the input's gradient, the graph kept
            before = _ops()
            torch.autograd.grad(loss, x, retain_graph=True)
            out["aside"].append({op: n - before.get(op, 0) for op, n in _ops().items() if n != before.get(op, 0)})
        if scenario == "create_graph":
            loss.backward(create_graph=True)
        else:
            loss.backward()
        if scenario == "grad_data":
            return {"read": float(model.head.weight.grad.data.norm())}
        out["steps"].append(_ops())
        engine.step()
        engine.zero_grad(set_to_none=scenario != "zero_grad_keep")
        out["losses"].append(comm.monitor_mean(loss.item()))
    out["params"] = engine.full_state_dict()
    engine.close()
    return out


def many(runs: list[dict]) -> list[dict | str]:
    """Several :func:`train` runs in one process group; an exception becomes its message."""
    out = []
    for kw in runs:
        try:
            out.append(train(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out


# ----- users' loops: habits of a torch user around the engine ------------------------------
class Positions(nn.Module):
    """A learned positional table whose forward returns a view of its own weight."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * 0.1)

    def forward(self, rows: int):
        return self.weight[:rows]


class PosNet(nn.Module):
    """Positions (a ZeRO-3 unit returning a view of its parameter) added to a linear layer's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos, self.inp, self.head = Positions(16, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x) + self.pos(1)))  # one position for every row


def _habit_model(habit: str) -> nn.Module:
    return PosNet() if habit == "view_unit" else Net()


def habit_reference(habit: str) -> dict:
    """Plain torch on the whole batch for ``habit``."""
    model = _habit_model(habit)
    opt = (torch.optim.Adam(model.parameters(), lr=LR / 10, amsgrad=True) if habit == "amsgrad"
           else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    losses = []
    for step in range(STEPS):
        model.use_side = step > 0 or habit != "amsgrad"
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if habit == "clip_groups":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        model.zero_grad() if habit == "model_zero_grad" else opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def habit(habit: str, stage: int | None) -> dict:
    """``habit`` at ``stage`` on this rank's slice of the batch (None: :func:`habit_reference`)."""
    if stage is None:
        return habit_reference(habit)
    ctx = zdist.context()
    model = _habit_model(habit)
    kw = dict(optimizer="adam", lr=LR / 10) if habit == "amsgrad" else dict(optimizer="sgd", lr=LR, momentum=0.9)
    engine = make_engine(stage, model, bucket_mb=0.0005, **kw)
    if habit == "amsgrad":
        engine.optimizer.param_groups[0]["amsgrad"] = True
    if habit == "wrap_twice":  # a notebook cell run again while the first engine lives
        make_engine(stage, model, bucket_mb=0.0005, **kw)
    scaler = torch.amp.GradScaler("cpu") if habit == "grad_scaler" else None
    losses = []
    for step in range(STEPS):
        model.use_side = step > 0 or habit != "amsgrad"
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
        loss = F.mse_loss(engine(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(engine.optimizer)
            scaler.update()
        else:
            loss.backward()
            if habit == "clip_groups":  # Lightning's habit: clip what the optimizer holds
                torch.nn.utils.clip_grad_norm_([p for g in engine.optimizer.param_groups for p in g["params"]], CLIP)
            engine.step()
        model.zero_grad() if habit == "model_zero_grad" else engine.zero_grad()
        losses.append(comm.monitor_mean(loss.item()))
    out = {"losses": losses, "params": engine.full_state_dict()}
    engine.close()
    return out


def habits(runs: list[dict]) -> list[dict | str]:
    """Several :func:`habit` runs in one process group; an exception becomes its message."""
    out = []
    for kw in runs:
        try:
            out.append(habit(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out
