"""A PyTorch user's habits around an engine, for spawned gloo ranks: each scenario trains
a small model on this rank's slice (or, with ``stage=None``, in one process on the whole
batch with plain torch, the reference) and returns losses and parameters, or the error it
raised as ``"ConfigError: ..."``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine

BATCH, STEPS, LR, CLIP = 12, 3, 0.1, 0.05


class Net(nn.Module):
    """Three linear layers (ZeRO-3 units), dropout, and buffers in float64 (a counter past
    2^24, which fp32 cannot count), float16 and int16."""

    def __init__(self, dropout: float = 0.0, frozen_mid: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("count64", torch.tensor(2.0**30, dtype=torch.float64))
        self.register_buffer("f16", torch.full((16,), 0.5, dtype=torch.float16))
        self.register_buffer("i16", torch.tensor([1, 2], dtype=torch.int16))
        if frozen_mid:
            self.mid.requires_grad_(False)

    def forward(self, x):
        if self.training:
            self.count64 += 1
        h = torch.tanh(self.inp(x)) * self.f16.float()
        return self.head(self.drop(torch.tanh(self.mid(h))))


class LoRA(nn.Module):
    """A frozen bf16 base weight with fp32 low-rank adapters (QLoRA-style)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).to(torch.bfloat16).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + x @ self.a.t() @ self.b.t()


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = LoRA(8, 16), LoRA(16, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class ScaledNet(Net):
    """Net with a ``nn.ParameterList`` child: one scale per hidden layer."""

    def __init__(self):
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.full((16,), 1.0 + k / 4)) for k in range(2)])

    def forward(self, x):
        h = torch.tanh(self.inp(x)) * self.scales[0]
        return self.head(torch.tanh(self.mid(h)) * self.scales[1])


def build(scenario: str) -> nn.Module:
    if scenario == "lora_bf16":
        return LoRANet()
    if scenario == "param_list":
        return ScaledNet()
    if scenario in ("weight_norm", "spectral_norm"):  # torch's hook-based norms, on a unit
        model = Net()
        norm = torch.nn.utils.weight_norm if scenario == "weight_norm" else torch.nn.utils.spectral_norm
        norm(model.mid)
        return model
    return Net(dropout=0.5 if scenario == "eval_dropout" else 0.0, frozen_mid=scenario == "unfreeze")


def batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def schedule(scenario: str, opt):
    if scenario == "lambda_lr":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    if scenario == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return None


def reference(scenario: str) -> dict:
    """Plain torch, one process, the whole batch: what every scenario must equal."""
    model = build(scenario)
    if scenario == "eval_dropout":
        model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    sched = schedule(scenario, opt)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=scenario == "retain")
        if scenario == "retain":
            loss.backward()
        if scenario in ("clip_user", "clip_engine"):
            norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def train(scenario: str, stage: int | None) -> dict:
    """``scenario`` at ``stage`` on this rank's slice (None: :func:`reference`)."""
    if stage is None:
        return reference(scenario)
    ctx = zdist.context()
    model = build(scenario)
    if scenario == "compile":
        model = torch.compile(model, backend="eager")
    keys = sorted(model.state_dict())  # the user's names, before wrapping
    engine = make_engine(stage, model, optimizer="sgd", lr=LR, momentum=0.9, bucket_mb=0.0005)
    out: dict = {"training": []}
    if scenario == "load":
        full = {n: t.clone() for n, t in build(scenario).state_dict().items()}
        model.load_state_dict(full)
    if hasattr(model, "i16"):
        model.i16.fill_(5 + ctx.rank)  # rank 0's values reach every rank at the next forward
    if scenario == "eval_dropout":
        out["training"].append(engine.eval().training)
    sched = schedule(scenario, engine.optimizer)
    losses, norms = [], []
    for step in range(STEPS):
        if scenario == "unfreeze" and step == 1:
            model.mid.requires_grad_(True)
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
        loss = F.mse_loss(engine(x), y)
        if scenario == "loss_backward":
            loss.backward()
        elif scenario == "retain":
            engine.backward(loss, retain_graph=True)
            engine.backward(loss)
        else:
            engine.backward(loss)
        if scenario == "clip_user":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        elif scenario == "clip_engine":
            norms.append(engine.clip_grad_norm_(CLIP).item())
        if scenario == "opt_step":
            engine.optimizer.step()
            engine.optimizer.zero_grad()
        else:
            engine.step()
            engine.zero_grad(set_to_none=scenario != "zero_grad_keep")
        if sched is not None:
            sched.step()
        losses.append(comm.monitor_mean(loss.item()))
    if scenario == "eval_dropout":
        out["training"].append(engine.train().training)
        engine.eval()
    params = {n.removeprefix("_orig_mod."): t for n, t in engine.full_state_dict().items()}
    out.update(losses=losses, norms=norms, params=params,
               buffers={n.removeprefix("_orig_mod."): b.clone() for n, b in model.named_buffers()},
               names=[n for n, _ in engine.named_parameters()] == [n for n, _ in model.named_parameters()],
               state_dict_keys=sorted(engine.state_dict()) == keys,
               lr=engine.optimizer.param_groups[0]["lr"])
    engine.close()
    return out


def many(runs: list[dict]) -> list[dict | str]:
    """Several :func:`train` runs in one process group; an exception becomes
    ``"<type>: <message>"`` (a ConfigError is expected where a habit is refused)."""
    out = []
    for kw in runs:
        try:
            out.append(train(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out
