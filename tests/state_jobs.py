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


def module_face(stage: int) -> dict:
    """What ``engine.modules()``, ``named_modules()``, ``children()``, ``apply(fn)`` and
    ``engine.to(...)`` answer at ``stage``, against the wrapped model's own answers."""
    model = Net()
    engine = make_engine(stage, model, optimizer="sgd", lr=LR)
    visited: list = []
    out = {
        "modules": [a is b for a, b in zip(engine.modules(), model.modules(), strict=True)],
        "named_modules": [n for n, _ in engine.named_modules()] == [n for n, _ in model.named_modules()],
        "children": [a is b for a, b in zip(engine.children(), model.children(), strict=True)],
        "apply_returns_engine": engine.apply(visited.append) is engine,
        "apply_visits": [a is b for a, b in zip(visited, [*model.children(), model], strict=True)],
        "to_same": engine.to("cpu") is engine and engine.to(torch.device("cpu"), torch.float32) is engine,
    }
    for name, args in (("to_dtype", (torch.float64,)), ("to_device", ("meta",))):
        try:
            engine.to(*args)
            out[name] = "moved"
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out[name] = f"{type(e).__name__}: {e}"
    x, y = (data.rank_slice(t, zdist.context().rank, zdist.context().world_size) for t in batch(0))
    F.mse_loss(engine(x), y).backward()  # the engine still trains after all of it
    out["trained"] = bool(engine.step())
    engine.close()
    return out


def module_faces(stages: list[int]) -> list[dict]:
    """:func:`module_face` at each of ``stages``, in one process group."""
    return [module_face(stage) for stage in stages]


def failed_backward(stage: int | None, then: str = "zero_grad", how: str = "loss") -> dict:
    """Four SGD-momentum steps in which step 1's backward raises midway (a hook on ``mid``'s
    output, after the head's gradients arrived and small buckets began reducing); the user
    catches the error and calls ``zero_grad`` (``then="zero_grad"``), goes straight on to the
    next forward (``"forward"``) or steps (``"step"``). ``how``: ``loss.backward()`` or
    ``engine.backward(loss)``. ``stage`` None: plain torch on the whole batch."""
    model = Net()
    armed = {"on": False}

    def arm(module, args, out):
        if armed["on"]:
            out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom in backward")))

    model.mid.register_forward_hook(arm)
    engine = None if stage is None else make_engine(stage, model, optimizer="sgd", lr=LR, momentum=0.9,
                                                    bucket_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9) if engine is None else engine
    said = []
    for step in range(4):
        armed["on"] = step == 1
        x, y = batch(step)
        if engine is not None:
            x, y = (data.rank_slice(t, zdist.context().rank, zdist.context().world_size) for t in (x, y))
        loss = F.mse_loss((engine or model)(x), y)
        try:
            engine.backward(loss) if how == "engine" else loss.backward()
        except RuntimeError as e:
            said.append(str(e))
            if then == "zero_grad" or engine is None:
                opt.zero_grad()
            if then != "step" or engine is None:
                continue
        opt.step()
        opt.zero_grad()
    params = engine.full_state_dict() if engine is not None else {n: p.detach().clone()
                                                                   for n, p in model.named_parameters()}
    if engine is not None:
        engine.close()
    return {"said": said, "params": params}


def failed_backwards(runs: list[dict]) -> list:
    """Several :func:`failed_backward` runs in one process group; an exception becomes its message."""
    out = []
    for kw in runs:
        try:
            out.append(failed_backward(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out


# ----- users' loops: the optimizer as torch's, resumes, refusals ---------------------------
class KwNet(Net):
    """:class:`Net` called with a keyword-only input, returning a dict (Hugging Face's manner)."""

    def forward(self, *, x, scale=None):
        return {"out": super().forward(x) * (1.0 if scale is None else scale)}


OPTIMIZER_HABITS = {  # habit -> (engine options, the plain torch optimizer it matches)
    "nesterov": (dict(optimizer="sgd", lr=LR, momentum=0.9, optimizer_kwargs={"nesterov": True}),
                 lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True)),
    "maximize": (dict(optimizer="adam", lr=LR / 10, optimizer_kwargs={"maximize": True, "eps": 1e-6}),
                 lambda ps: torch.optim.Adam(ps, lr=LR / 10, maximize=True, eps=1e-6)),
    "lr0": (dict(optimizer="sgd", lr=0.0, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9)),
    "inputs_backward": (dict(optimizer="sgd", lr=LR, momentum=0.9),
                        lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9)),
    "clip_value": (dict(optimizer="sgd", lr=LR, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9)),
    "resume": (dict(optimizer="adam", lr=LR / 10, optimizer_kwargs={"amsgrad": True}),
               lambda ps: torch.optim.Adam(ps, lr=LR / 10, amsgrad=True)),
    "plain_resume": (dict(optimizer="adam", lr=LR / 10), lambda ps: torch.optim.Adam(ps, lr=LR / 10)),
}


def _optimizer_step(habit: str, model, x, y, opt=None) -> torch.Tensor:
    """One step's forward and backward as the habit has it (``opt``: plain torch's, stepped here)."""
    loss = F.mse_loss(model(x), y)
    if habit == "inputs_backward":  # an input's gradient first (a saliency map), the graph kept
        torch.autograd.backward(loss, inputs=[x], retain_graph=True)
    loss.backward()
    if habit == "clip_value":
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


def optimizer_reference(habit: str) -> dict:
    """Plain torch, one process, the whole batch, with the habit's torch optimizer."""
    model = Net()
    opt = OPTIMIZER_HABITS[habit][1](model.parameters())
    losses, state = [], None
    for step in range(STEPS):
        model.use_side = step > 0
        x, y = batch(step)
        losses.append(_optimizer_step(habit, model, x.requires_grad_(), y, opt).item())
        if step == 0:
            state = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": [state.get(i, {}).get("exp_avg") for i in range(len(list(model.parameters())))]}


def optimizer_habit(habit: str, stage: int) -> dict:
    """``habit`` at ``stage`` on this rank's slice; "resume": the DDP habit (every rank takes
    the optimizer's state_dict, rank 0 saves it, every rank loads it into a new engine at
    another bucket size) after step 1; "plain_resume": plain torch's first step loaded into
    an engine that takes the others."""
    import os
    import tempfile

    import torch.distributed as dist

    ctx = zdist.context()
    options = OPTIMIZER_HABITS[habit][0]
    model = Net()
    if habit == "plain_resume":  # step 0 in plain torch on the whole batch, then the engine
        opt = OPTIMIZER_HABITS[habit][1](model.parameters())
        model.use_side = False
        _optimizer_step(habit, model, batch(0)[0], batch(0)[1], opt)
        plain = opt.state_dict()
    engine = make_engine(stage, model, bucket_mb=0.0005, **options)
    if habit == "plain_resume":
        engine.optimizer.load_state_dict(plain)
    out: dict = {"losses": [], "state": None, "steps": []}
    for step in range(1 if habit == "plain_resume" else 0, STEPS):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
        comm.LEDGER.reset()
        model.use_side = step > 0
        loss = F.mse_loss(engine(x.requires_grad_()), y)
        if habit == "inputs_backward":
            before = _ops()
            torch.autograd.backward(loss, inputs=[x], retain_graph=True)
            out["aside"] = {op: n - before.get(op, 0) for op, n in _ops().items() if n != before.get(op, 0)}
        loss.backward()
        if habit == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        out["steps"].append(_ops())
        engine.step()
        engine.zero_grad()
        out["losses"].append(comm.monitor_mean(loss.item()))
        if step == 0 and options["optimizer"] == "adam":  # this rank's part of each parameter's state
            out["state"] = [_held(engine, p) for p in model.parameters()]
        if step == 0 and habit == "resume":
            whole = engine.optimizer.state_dict()  # a collective: every rank
            path = os.path.join(tempfile.gettempdir(), f"zerolearn-resume-{os.getppid()}-{stage}.pt")
            if ctx.rank == 0:
                torch.save({"model": engine.full_state_dict(), "optimizer": whole}, path)
            else:
                engine.full_state_dict()
            dist.barrier()
            saved = torch.load(path)
            out["buckets_before"] = len(engine.buckets)
            engine.close()
            model = Net()
            model.load_state_dict(saved["model"])
            engine = make_engine(stage, model, bucket_mb=0.002, **options)  # other buckets
            engine.optimizer.load_state_dict(saved["optimizer"])
            out["buckets"] = len(engine.buckets)
    out["params"] = engine.full_state_dict()
    engine.close()
    return out


def _held(engine, p) -> torch.Tensor | None:
    try:
        return engine.optimizer.state[p]["exp_avg"].clone()
    except KeyError:
        return None


def optimizer_refusal(habit: str, stage: int) -> str:
    """What the engine says to a habit it refuses: the error's text (or "trained" if none)."""
    import torch.distributed as dist

    ctx = zdist.context()
    model = Net()
    if habit == "embedding_max_norm":
        model.emb = nn.Embedding(10, 8, max_norm=1.0)
    if habit == "lazy":
        model.inp = nn.LazyLinear(16)
    try:
        options = dict(optimizer="sgd", lr=LR, momentum=0.9)
        if habit == "dampening_kwarg":
            options["optimizer_kwargs"] = {"dampening": 0.5}
        if habit in ("clip_groups_offload", "clip_groups_dpu"):  # Lightning's clipping over the host masters
            options.update(offload="cpu", dpu=habit == "clip_groups_dpu")
        engine = make_engine(stage, model, bucket_mb=0.0005, **options)
        if habit == "dampening_group":
            engine.optimizer.param_groups[0]["dampening"] = 0.5
        if habit == "other_ranks_shards":
            theirs = [engine.optimizer.shard_state_dict()]
            dist.broadcast_object_list(theirs, src=0)  # rank 0's shards, on every rank
        user = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9) if habit == "users_optimizer" else None
        for step in range(3 if habit == "clip_groups_dpu" else 1):  # DPU: its thread steps from step 1 on
            x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
            loss = F.mse_loss(engine(x), y)
            loss.backward()
            if habit == "clip_value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            if habit.startswith("clip_groups") and (habit != "clip_groups_dpu" or step == 2):
                torch.nn.utils.clip_grad_norm_([p for g in engine.optimizer.param_groups for p in g["params"]], CLIP)
            (user or engine).step()
            engine.zero_grad()
        if habit == "other_ranks_shards":
            engine.optimizer.load_state_dict(theirs[0])
        engine.close()
        return "trained"
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        return f"{type(e).__name__}: {e}"


def optimizer_habits(runs: list[dict]) -> list:
    """Several habit runs (``kind``: "exact" or "refused") in one process group."""
    out = []
    for kw in runs:
        fn = optimizer_habit if kw.pop("kind") == "exact" else optimizer_refusal
        try:
            out.append(fn(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out


def nan_skip(stage: int, timeout_s: float) -> str:
    """Rank 1 skips backward and step for a NaN loss (the user's guard, on one rank), then
    goes on; the engine's process group times out after ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    ctx = zdist.context()
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    engine = make_engine(stage, Net(), optimizer="sgd", lr=LR, momentum=0.9, bucket_mb=0.0005, group=group)
    for step in range(3):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(step))
        loss = F.mse_loss(engine(x), y)
        if step == 1 and ctx.rank == 1:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            continue
        loss.backward()
        engine.step()
        engine.zero_grad()
    return "trained"


def hf_batch_model(kind: str):
    """A tiny Hugging Face model built in code and one batch of keyword inputs for it:
    ``"resnet"`` (BatchNorm, pixel_values) or ``"wav2vec2"`` (CTC over raw audio)."""
    import transformers as T

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "resnet":
        cfg = T.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
        return T.ResNetForImageClassification(cfg), {"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
                                                     "labels": torch.randint(0, 3, (4,), generator=g)}
    cfg = T.Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                           num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, feat_extract_norm="group",
                           mask_time_prob=0.0, ctc_loss_reduction="mean")
    return T.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(4, 400, generator=g),
                                   "labels": torch.randint(1, 12, (4, 5), generator=g)}


def bf16_batches(kind: str, stage: int | None) -> list[float]:
    """Two SGD steps of ``kind`` ("kw": :class:`KwNet` called with keywords, "positional":
    :class:`Net`; or :func:`hf_batch_model`'s) in bf16 at ``stage``, losses; None: fp32,
    plain torch, one process."""
    if kind in ("kw", "positional"):
        model, batches = (KwNet() if kind == "kw" else Net()), [batch(s) for s in range(2)]
    else:
        model, one = hf_batch_model(kind)
        batches = [one, one]
    if stage is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for b in batches:
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    ctx = zdist.context()
    engine = make_engine(stage, model, optimizer="sgd", lr=0.05, momentum=0.9, dtype="bf16", bucket_mb=0.01)
    losses = []
    for b in batches:
        if kind in ("kw", "positional"):
            x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in b)
            out = engine(x=x, scale=torch.ones(()))["out"] if kind == "kw" else engine(x)
            loss = F.mse_loss(out.float(), y)
        else:
            loss = engine(**{k: data.rank_slice(v, ctx.rank, ctx.world_size) for k, v in b.items()}).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(comm.monitor_mean(loss.item()))
    engine.close()
    return losses


def many_bf16(runs: list[dict]) -> list:
    out = []
    for kw in runs:
        try:
            out.append(bf16_batches(**kw))
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            out.append(f"{type(e).__name__}: {e}")
    return out


# torch's names (CommDebugMode) of the collectives the ledger books by the package's names
C10D_NAMES = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_":
              "reduce_scatter", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
              "broadcast_": "broadcast"}


def counted_by_torch(stage: int) -> dict:
    """One training step at ``stage``: the collectives torch's ``CommDebugMode`` counts (by
    the package's names) beside the ones the ledger books."""
    from torch.distributed.tensor.debug import CommDebugMode

    ctx = zdist.context()
    engine = make_engine(stage, Net(), optimizer="sgd", lr=LR, momentum=0.9, bucket_mb=0.0005)
    x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(0))
    comm.LEDGER.reset()
    with CommDebugMode() as mode:
        F.mse_loss(engine(x), y).backward()
        engine.step()
    seen: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = C10D_NAMES.get(str(op).rsplit(".", 1)[-1], str(op))
        seen[name] = seen.get(name, 0) + n
    engine.close()
    return {"torch": seen, "ledger": _ops()}


def gradient_penalty(stage: int | None) -> dict:
    """Two SGD steps of a loss with a gradient penalty on the input (WGAN-GP's manner:
    ``torch.autograd.grad(out.sum(), x, create_graph=True)``, then one backward through
    both), at ``stage`` on this rank's rows (None: plain torch, one process, all rows)."""
    model = Net()
    if stage is None:
        opt, forward, rows = torch.optim.SGD(model.parameters(), lr=LR), model, (lambda t: t)
    else:
        ctx = zdist.context()
        engine = make_engine(stage, model, optimizer="sgd", lr=LR, bucket_mb=0.0005)
        opt, forward, rows = engine, engine, (lambda t: data.rank_slice(t, ctx.rank, ctx.world_size))
    try:
        for step in range(2):
            x, y = (rows(t) for t in batch(step))
            x.requires_grad_()
            out = forward(x)
            g, = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = F.mse_loss(out, y) + 0.1 * ((g.norm(dim=1) - 1) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        return {"error": f"{type(e).__name__}: {e}"}
    return {"params": engine.full_state_dict() if stage is not None else
            {n: p.detach().clone() for n, p in model.named_parameters()}}


def many_penalties(stages: list[int]) -> list[dict]:
    return [gradient_penalty(s) for s in stages]
