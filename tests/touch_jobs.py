"""Jobs for tests/test_touched_params.py: parameters read, changed, replaced or cast
outside the engine's forward, on spawned gloo ranks (importable by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine

STEPS, BATCH = 3, 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x))))


class Router(nn.Module):
    """Casts its classifier to fp32 inside its own forward, as Hugging Face Switch
    Transformer's router does (``self.classifier = self.classifier.to(self.dtype)``)."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(16, 32)

    def forward(self, h):
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(h.float())


class CastsItself(Net):
    def __init__(self):
        super().__init__()
        self.head = Router()


def batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randint(0, 32, (BATCH, 8), generator=g)
    return x, x.roll(-1, dims=1)


def loss_of(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def clamp_(model: nn.Module) -> None:
    with torch.no_grad():
        model.mix.weight.clamp_(-0.05, 0.05)


def reference(how: str) -> dict:
    """One process on the whole batch, clamping the mixer after every step (``how`` any)."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        clamp_(model)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def clamped(stage: int, how: str) -> dict:
    """The engine at ``stage``, the mixer clamped after every step: ``how`` = "summon"
    (inside summon_full_params) or "direct" (in place on the parameter, stages 0-2)."""
    ctx = zdist.context()
    model = Net()
    engine = make_engine(stage, model, optimizer="adam", lr=0.05, bucket_mb=0.001)
    losses = []
    for step in range(STEPS):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        if how == "summon":
            with engine.summon_full_params():
                clamp_(model)
        else:
            clamp_(model)
        losses.append(loss.item() * x.shape[0] / BATCH)
    return {"losses": losses, "params": engine.full_state_dict()}


def attempt(fn) -> str | None:
    """None if ``fn()`` ran; else the error's type and message."""
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        return f"{type(e).__name__}: {e}"


def outside_reads(stage: int) -> dict:
    """Reads and writes of parameters between steps, each as the user writes it."""
    ctx = zdist.context()
    model = Net()
    engine = make_engine(stage, model, optimizer="adam", lr=0.05)
    x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(0))

    def l2_term():
        loss = loss_of(engine(x), y) + 1e-3 * model.mix.weight.pow(2).sum()
        engine.backward(loss)

    def step():
        engine.backward(loss_of(engine(x), y))
        engine.step()
        engine.zero_grad()

    out = {"norm": attempt(lambda: model.mix.weight.norm().item()),
           "clamp": attempt(lambda: clamp_(model)),
           "load": attempt(lambda: model.load_state_dict(Net().state_dict())),
           "data_clamp": attempt(lambda: model.mix.weight.data.clamp_(-1, 1)),
           "repr": attempt(lambda: repr(model.mix.weight)),
           "l2": attempt(l2_term)}
    engine.zero_grad()
    out["then_step"] = attempt(step)  # the engine still trains after the refusals
    with engine.summon_full_params(writeback=False):
        out["norm_inside"] = model.mix.weight.norm().item()
    out["norm_full"] = engine.full_state_dict()["mix.weight"].norm().item()
    return out


def loaded(stage: int) -> dict:
    """engine.load_state_dict with another model's weights, then one step; and the same
    weights loaded before wrapping."""
    ctx = zdist.context()
    torch.manual_seed(1)
    other = nn.Linear(16, 16).state_dict()
    runs = {}
    for when in ("engine", "before"):
        model = Net()
        if when == "before":
            model.mix.load_state_dict(other)
        engine = make_engine(stage, model, optimizer="adam", lr=0.05)
        if when == "engine":
            engine.load_state_dict({f"mix.{k}": v for k, v in other.items()}, strict=False)
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(0))
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        runs[when] = {"loss": loss.item(), "params": engine.full_state_dict()}
    return runs


def replaced(stage: int, what: str, dtype: str = "fp32") -> str | None:
    """A parameter, a module or a parameter's dtype changed after wrapping; the error."""
    ctx = zdist.context()
    model = CastsItself() if what == "cast" else Net()
    engine = make_engine(stage, model, optimizer="adam", lr=0.05, dtype=dtype)
    x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(0))
    if what == "module":
        model.head = nn.Linear(16, 32)
    elif what == "parameter":
        model.mix.weight = nn.Parameter(torch.zeros(16, 16))

    def step():
        engine.backward(loss_of(engine(x), y))
        engine.step()

    return attempt(step)


class ComplexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x):
        return (x.to(torch.complex64) @ self.w).abs()


def refused_at_wrap(stage: int, kind: str) -> str | None:
    """Wrapping a model with a complex parameter or a sparse embedding; the error."""
    model = ComplexNet() if kind == "complex" else nn.Sequential(nn.Embedding(32, 8, sparse=True), nn.Linear(8, 2))
    return attempt(lambda: make_engine(stage, model))


def sparse_functional(stage: int) -> str | None:
    """A sparse gradient made by F.embedding(..., sparse=True) in forward; the error."""
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(32, 8))

        def forward(self, x):
            return F.embedding(x, self.table, sparse=True).sum()

    engine = make_engine(stage, Functional())
    return attempt(lambda: engine.backward(engine(torch.randint(0, 32, (4,)))))


def many(calls: list[tuple[str, tuple]]) -> list:
    """Several of the jobs above in one process group."""
    return [globals()[name](*args) for name, args in calls]
