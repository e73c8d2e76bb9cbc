"""Functions the multi-rank tests run on spawned gloo ranks (importable by name), and
:func:`on_ranks`, the persistent ranks they run on."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.models import GPTConfig, build_model

# ----- persistent ranks ------------------------------------------------------------------
# Starting ranks (each a process that imports torch and joins a process group) takes
# longer than most jobs here. on_ranks runs a job as zerolearn.dist.launch does, on ranks
# kept for the whole test session: one pool (zerolearn.live.Ranks) per world size.
# Tests of launch itself, of failing ranks, of what ranks print, and of ZEROLEARN_* variables
# call launch: each needs ranks of its own.
POOL_TIMEOUT_S = 300.0  # per job, launch's default
_POOLS: dict = {}


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("ZEROLEARN_")}


_SESSION_ENV = _environment()  # at collection, before any test sets one


def on_ranks(fn, world_size: int, *args, **kwargs) -> list:
    """``fn(*args, **kwargs)`` on every rank of the session's ``world_size`` pool; results by rank.

    Raises zerolearn.live.CellError (the failing ranks' tracebacks) where launch raises
    RankError or TimeoutError; the pool then restarts if a rank hung or died. A job that
    needs ZEROLEARN_* variables of its own needs fresh ranks (launch): pooled ranks keep
    the environment they started with, so a changed one is refused here.
    """
    from zerolearn import live

    env = _environment()
    changed = sorted(k for k in env.keys() | _SESSION_ENV.keys() if env.get(k) != _SESSION_ENV.get(k))
    if changed:
        raise RuntimeError(f"on_ranks: {', '.join(changed)} changed since the session began; "
                           "the pooled ranks would not see it (use zerolearn.dist.launch)")
    if world_size not in _POOLS:
        _POOLS[world_size] = live.Ranks(world_size, timeout_s=POOL_TIMEOUT_S)
    return _POOLS[world_size].call(fn, *args, **kwargs)


def close_pools() -> None:
    """Stop every pool :func:`on_ranks` started."""
    while _POOLS:
        _POOLS.popitem()[1].close()


# ----- training jobs -----------------------------------------------------------------------
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
                 max_grad_norm: float | None = None, accum_style: str = "sync", engine_cls=None,
                 prefetch_mb: float | None = None) -> dict:
    """Train with our engine on this rank's slices; return losses, params, ledgers.

    ``accum_style`` says how micro-batches are written: ``"sync"`` (``sync=False``
    until the last), ``"no_sync"`` (the context manager), ``"repeated"`` (plain
    ``backward`` each time, as a PyTorch user writes it) or ``"mixed"`` (even
    micro-batches and the last reduce, odd ones add up locally). ``engine_cls``: an
    ``Engine`` subclass to train instead of ``stage``'s (importable by name).
    ``prefetch_mb``: ZeRO-3's, when given.
    """
    ctx = zdist.context()
    net = small_gpt() if model == "gpt" else frozen_model()
    options = dict(optimizer=optimizer, lr=LR[optimizer], dtype=dtype, bucket_mb=bucket_mb,
                   max_grad_norm=max_grad_norm, **({} if prefetch_mb is None else {"prefetch_mb": prefetch_mb}))
    engine = make_engine(stage, net, **options) if engine_cls is None else engine_cls(net, **options)
    comm.LEDGER.reset()
    losses, grads_bytes = [], None
    for step in range(steps):
        x, y = global_batch(step) if model == "gpt" else frozen_batch(step)
        x, y = data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)
        local = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            if model == "gpt":
                loss = gpt_loss(engine(xm), ym)
            else:
                loss = F.mse_loss(engine(xm.to(engine.dtype), step % 2 == 1).float(), ym)
            last = i == accum - 1
            if accum_style == "no_sync" and not last:
                with engine.no_sync():
                    engine.backward(loss / accum)
            elif accum_style == "mixed":  # reduce, add locally, reduce, ...: DDP allows any mix
                engine.backward(loss / accum, sync=last or i % 2 == 0)
            else:
                engine.backward(loss / accum, sync=last or accum_style == "repeated")
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
            "group_bytes": [g.layout.padded_numel * engine.dtype.itemsize for g in engine.buckets],
            "unit_bytes": [sum(g.layout.padded_numel for g in u.buckets) * engine.dtype.itemsize
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
            from torch.distributed.device_mesh import init_device_mesh

            fully_shard = compat.fully_shard()
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # the ranks' device, not CUDA's by default
            for unit in net.units():
                fully_shard(unit, mesh=mesh)
            wrapped = fully_shard(net, mesh=mesh)
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


def train_all_stages(config) -> list[dict]:
    """The training report of ``config`` at stages 0-3 in one process group."""
    from zerolearn.train import train

    return [train(config.replace(stage=s)) for s in range(4)]


def resume_round_trip(stage: int, directory: str, steps: int = 4, split: int = 2) -> dict:
    """Train ``split`` steps, save a checkpoint, rebuild, load, finish; vs uninterrupted."""
    from zerolearn import checkpoint

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
    checkpoint.save(first, directory, split)
    second = make_engine(stage, small_gpt(seed=7), optimizer="adam", lr=LR["adam"], bucket_mb=0.01)
    assert checkpoint.load(second, directory) == split
    run(second, split, steps)
    return {"whole": whole.full_state_dict(), "resumed": second.full_state_dict()}


# ----- checkpoints and failures (test_checkpoint.py, test_failures.py) ----------------

def several(calls: list[tuple[str, dict]]) -> list:
    """Run several jobs of this module, by name, in one process group (saves spawning)."""
    return [globals()[name](**kwargs) for name, kwargs in calls]


def ckpt_engine(stage: int, optimizer: str = "adam", dtype: str = "fp32", seed: int = 0, net=None):
    """An engine on small_gpt; SGD with momentum, so that SGD has state to lose."""
    return make_engine(stage, net if net is not None else small_gpt(seed), optimizer=optimizer,
                       lr=LR[optimizer], momentum=0.9 if optimizer == "sgd" else 0.0, dtype=dtype,
                       bucket_mb=0.01)


def ckpt_steps(engine, first: int, last: int) -> list[float]:
    """Train steps [first, last) on this rank's slices; the global mean loss of each."""
    ctx = zdist.context()
    losses = []
    for step in range(first, last):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in global_batch(step))
        loss = gpt_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(comm.monitor_mean(loss.item()))
    return losses


def ckpt_reference(optimizer: str, steps: int) -> list[float]:
    """Plain single-process PyTorch losses for ckpt_engine's job (SGD with momentum 0.9)."""
    net = small_gpt()
    opt = (torch.optim.SGD(net.parameters(), lr=LR["sgd"], momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(net.parameters(), lr=LR[optimizer]))
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        loss = gpt_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ckpt_save_after(stage: int, optimizer: str, steps: int, directory: str, dtype: str = "fp32") -> dict:
    """Train ``steps`` steps from scratch, then save; losses and the loss scaler's state."""
    from zerolearn import checkpoint

    engine = ckpt_engine(stage, optimizer, dtype)
    losses = ckpt_steps(engine, 0, steps)
    checkpoint.save(engine, directory, steps, extra={"note": "test"})
    return {"losses": losses, "scaler": engine.scaler.state_dict()}


def ckpt_resume(stage: int, optimizer: str, directory: str, last: int, save_to: str | None = None,
                dtype: str = "fp32") -> dict:
    """A fresh engine (other weights) loads ``directory``, optionally saves what it loaded
    (now at this stage and world size), and trains on to step ``last``."""
    from zerolearn import checkpoint

    engine = ckpt_engine(stage, optimizer, dtype, seed=7)
    first = checkpoint.load(engine, directory)
    if save_to is not None:
        checkpoint.save(engine, save_to, first)
    loaded = engine.full_state_dict()
    scaler = engine.scaler.state_dict()
    steps = sorted({float(s["step"]) for s in engine.optimizer.state.values() if "step" in s})
    return {"first": first, "loaded": loaded, "scaler": scaler, "adam_steps": steps,
            "losses": ckpt_steps(engine, first, last)}


def _snapshot(engine) -> dict:
    return {"params": engine.full_state_dict(),
            "optimizer": [{k: v.clone() for k, v in engine.optimizer.state[g.master].items()}
                          for g in engine.buckets],
            "scaler": dict(engine.scaler.state_dict())}


def _same_snapshot(a: dict, b: dict) -> bool:
    return (all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
            and all(torch.equal(x[k], y[k]) for x, y in zip(a["optimizer"], b["optimizer"], strict=True) for k in x)
            and a["scaler"] == b["scaler"])


def ckpt_bad_inputs(directory: str) -> dict:
    """Damaged and mismatched checkpoints: each load must fail cleanly, the model untouched."""
    import json
    import os
    import shutil

    from zerolearn import checkpoint
    from zerolearn.models import GPTConfig as Cfg

    ctx = zdist.context()
    engine = ckpt_engine(3, "adam")
    ckpt_steps(engine, 0, 1)
    good = os.path.join(directory, "good")
    checkpoint.save(engine, good, 1)
    others = {"fewer_layers": ckpt_engine(3, net=build_model("gpt", 0, gpt=Cfg(seq_len=16, n_layer=1, n_head=2,
                                                                                 d_model=32))),
              "narrower": ckpt_engine(3, net=build_model("gpt", 0, gpt=Cfg(seq_len=16, n_layer=2, n_head=2,
                                                                             d_model=16))),
              "sgd": ckpt_engine(3, "sgd")}
    for name, other in others.items():
        ckpt_steps(other, 0, 1)
        checkpoint.save(other, os.path.join(directory, name), 1)
    ckpt_steps(engine, 1, 2)  # the engine moves on: a partial load would show
    cases = {n: os.path.join(directory, n) for n in
             ("missing_shard", "truncated", "world_size", "uncovered", "garbled_manifest", "empty")}
    if ctx.rank == 0:
        src = checkpoint.latest(good)
        for name, path in cases.items():
            if name != "empty":
                shutil.copytree(src, path)
            else:
                os.makedirs(path)
        os.remove(os.path.join(cases["missing_shard"], "rank_00001.pt"))
        victim = os.path.join(cases["truncated"], "rank_00000.pt")
        os.truncate(victim, os.path.getsize(victim) // 2)
        for name in ("world_size", "uncovered"):
            path = os.path.join(cases[name], "manifest.json")
            man = json.load(open(path))
            if name == "world_size":  # says 3 ranks saved, has files of 2
                man["world_size"] = 3
            else:  # as if rank 1 had never written: its elements are nowhere
                man["world_size"], man["files"] = 1, man["files"][:1]
                for g in man["groups"]:
                    g["pieces"] = [p for p in g["pieces"] if p[0] == 0]
            json.dump(man, open(path, "w"))
        with open(os.path.join(cases["garbled_manifest"], "manifest.json"), "w") as f:
            f.write('{"format": "zerolearn-checkpoint", ')
    comm.barrier()
    cases.update({n: os.path.join(directory, n) for n in others})
    before = _snapshot(engine)
    messages = {}
    for name, path in cases.items():
        try:
            checkpoint.load(engine, path)
            messages[name] = None
        except checkpoint.CheckpointError as e:
            messages[name] = str(e)
    untouched = _same_snapshot(before, _snapshot(engine))
    losses = ckpt_steps(engine, 2, 3)  # still trains: no rank was left behind in a collective
    return {"messages": messages, "untouched": untouched, "losses": losses}


def ckpt_crash_during_save(directory: str) -> None:
    """Stage 0: save at step 2, then rank 1 dies half-way through writing its file at step 4.

    (At stage 0 rank 0 alone writes parameters; rank 1's file holds its random state.)
    """
    import os

    from zerolearn import checkpoint
    from zerolearn.checkpoint import engine_io

    engine = ckpt_engine(0, "adam")
    ckpt_steps(engine, 0, 2)
    checkpoint.save(engine, directory, 2)
    ckpt_steps(engine, 2, 4)
    if zdist.context().rank == 1:
        def write_half_and_die(path, write):
            import io
            buf = io.BytesIO()
            write(buf)
            with open(path + ".part", "wb") as f:
                f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
            os._exit(1)
        engine_io.write_atomic = write_half_and_die
    checkpoint.save(engine, directory, 4)


def ckpt_big_mlp(directory: str, width: int, layers: int) -> int:
    """Save a stage-3 Adam checkpoint of an MLP large enough to measure memory with."""
    from zerolearn import checkpoint

    ctx = zdist.context()
    net = build_model("mlp", 0, mlp_width=width, mlp_layers=layers)
    engine = make_engine(3, net, optimizer="adam", lr=1e-3, bucket_mb=4)
    x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in data.mlp_batch(0, 4, width))
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    checkpoint.save(engine, directory, 1)
    return engine.psi


def skip_unit_forward() -> float:
    """ZeRO-3 where rank 1 skips block 1's forward: a rank-dependent code path."""
    ctx = zdist.context()
    engine = ckpt_engine(3, "sgd")
    net = engine.model
    x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in global_batch(0))
    h = net.embed(x)
    for i, block in enumerate(net.blocks):
        if not (ctx.rank == 1 and i == 1):
            h = block(h)
    loss = gpt_loss(net.head(h), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def debug_mode_is_transparent(config) -> dict:
    """The training reports of ``config`` at stage 3 without and with debug_collectives, and the checks made."""
    from zerolearn import guard
    from zerolearn.train import train

    plain = [train(config.replace(stage=3))]
    before = guard.checks
    debug = [train(config.replace(stage=3, debug_collectives=True))]
    comm.set_debug(False)
    return {"plain": plain, "debug": debug, "checks": guard.checks - before}


def dead_rank() -> None:
    """Rank 1 vanishes after one step (exit code 0: the launcher cannot tell it failed)."""
    import os

    engine = ckpt_engine(2, "adam")
    ckpt_steps(engine, 0, 1)
    if zdist.context().rank == 1:
        os._exit(0)
    ckpt_steps(engine, 1, 2)


def fp16_overflow(stage: int, steps: int, inject: dict[int, tuple[int, float]]) -> dict:
    """fp16 training where ``inject[step] = (rank, value)`` puts ``value`` (inf, nan) into
    one gradient element of that rank only; loss scale 256, doubling after 2 clean steps."""
    ctx = zdist.context()
    engine = ckpt_engine(stage, "adam", dtype="fp16")
    engine.scaler.scale, engine.scaler.growth_interval = 256.0, 2
    param = engine.model.blocks[0].fc.weight
    flags, scales, unchanged = [], [], []

    def poison(value):
        def hook(grad):
            grad = grad.clone()
            grad.view(-1)[0] = value
            return grad
        return hook

    for step in range(steps):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in global_batch(step))
        before = engine.full_state_dict()
        rank, value = inject.get(step, (None, None))
        handle = param.register_hook(poison(value)) if rank == ctx.rank else None
        engine.backward(gpt_loss(engine(x), y))
        if handle is not None:
            handle.remove()
        flags.append(engine.step())
        engine.zero_grad()
        scales.append(engine.scaler.scale)
        after = engine.full_state_dict()
        unchanged.append(all(torch.equal(before[n], after[n]) for n in before))
    return {"flags": flags, "scales": scales, "unchanged": unchanged, "params": engine.full_state_dict(),
            "skipped": engine.scaler.skipped_steps}


def train_jobs(configs: list) -> list:
    """The training reports of several runs in a row, or the ConfigError's message."""
    from zerolearn.errors import ConfigError
    from zerolearn.train import train

    out = []
    for config in configs:
        try:
            out.append(train(config))
        except ConfigError as e:
            out.append(str(e))
    return out


def save_broken_parameters() -> str:
    """An engine whose fp32 master holds a NaN: the check before saving names it."""
    from zerolearn.train import check_finite_params

    engine = make_engine(1, small_gpt(), optimizer="adam", lr=1e-3)
    with torch.no_grad():
        engine.buckets[0].master[0] = float("nan")
    try:
        check_finite_params(engine, 3)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def train_with_per_rank_options(config, per_rank: dict[int, dict]) -> str:
    """:func:`zerolearn.train.train` where some ranks get other options (a job whose
    nodes were started differently); returns the error message, or "trained"."""
    from zerolearn.train import train

    rank = zdist.context().rank
    try:
        train(config.replace(**per_rank.get(rank, {})))
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        return f"{type(e).__name__}: {e}"
    return "trained"


def check_shared_marker(root: str) -> str:
    """Each rank checks a different folder (as nodes without a shared filesystem see
    one path as two folders); returns the error message, or "shared"."""
    import os

    from zerolearn import agree

    rank = zdist.context().rank
    try:
        agree.check_shared_dir(os.path.join(root, f"node{rank}"), rank)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "shared"


def freed_after_collectives(rounds: int) -> int:
    """Run ``rounds`` of a synchronous all_reduce and an asynchronous all_gather, each
    on a tensor dropped right after; return how many of those tensors were still
    alive (held by the backend) the moment they were dropped."""
    import weakref

    world = zdist.context().world_size
    alive = 0
    for _ in range(rounds):
        t = torch.ones(4096)
        ref = weakref.ref(t.untyped_storage())
        comm.all_reduce(t)
        del t
        alive += ref() is not None
        t, out = torch.ones(4096), torch.empty(4096 * world)
        refs = weakref.ref(t.untyped_storage()), weakref.ref(out.untyped_storage())
        handle = comm.all_gather(out, t, async_op=True)
        handle.wait()
        del t, out
        alive += any(r() is not None for r in refs)
    return alive


def functions_a_step_runs(stage: int) -> list[tuple[str, str]]:
    """The package's functions one training step runs at ``stage`` (the second step of a
    small GPT with Adam: forward, ``loss.backward()``, ``engine.step()``, ``zero_grad()``),
    each as (path from the repository root, qualified name); functions nested in another
    (comprehensions, lambdas, closures) are counted in it."""
    import sys
    import threading

    ctx = zdist.context()
    engine = make_engine(stage, small_gpt(), optimizer="adam", lr=1e-2, bucket_mb=0.01)
    root = os.path.dirname(os.path.dirname(os.path.abspath(comm.__file__)))
    seen: set = set()

    def one_step(step: int) -> None:
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in global_batch(step))
        gpt_loss(engine(x), y).backward()
        engine.step()
        engine.zero_grad()

    def note(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(root) and "<" not in code.co_qualname:
            seen.add((os.path.relpath(code.co_filename, root), code.co_qualname))

    one_step(0)
    threading.settrace(note)
    sys.settrace(note)
    try:
        one_step(1)
    finally:
        sys.settrace(None)
        threading.settrace(None)
        engine.close()
    return sorted(seen)
