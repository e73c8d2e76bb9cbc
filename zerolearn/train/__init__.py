"""The training loop: one job, any stage, any world size.

    python -m zerolearn.train --stage 2 --steps 20 --report run.json           # 1 rank
    torchrun --nproc-per-node 4 -m zerolearn.train --stage 3 --report run.json  # 4 ranks

In Python the same run is a :class:`zerolearn.config.TrainConfig`::

    report = train(TrainConfig(stage=2, steps=20))            # on an existing process group
    reports = launch(train, 4, TrainConfig(stage=2))          # on 4 spawned gloo ranks

Every rank builds the same model from ``--seed`` and, at each step, the same global
batch from (seed, step); rank r trains on its slice. So a run's losses depend on
neither the stage nor the world size, which is what lets the book compare them.

One step (:func:`train_step`), the same at every stage; the engine decides where
state lives and which collectives run (:class:`zerolearn.engines.Engine`)::

    batch(config, step) -> this rank's slice -> K micro-batches
        forward, loss / K, engine.backward(sync = last micro-batch)   # buckets reduce
    engine.step(); engine.zero_grad()                                # shard update, all-gather
    global mean loss (one all_reduce, not counted) -> checkpoint when due

The command line (``python -m zerolearn.train``, :mod:`zerolearn.train.__main__`), its exit
codes, checkpoints and failure handling: :mod:`zerolearn.cli`.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zerolearn import agree, checkpoint, comm, compat, data
from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.engines import Engine, make_engine
from zerolearn.errors import ConfigError
from zerolearn.faults import check_finite, check_finite_params, fail_on_purpose
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.models import GPTConfig, build_model
from zerolearn.report import make_report, saved_config
from zerolearn.residual import setup as residual_setup

# A resumed run must see the same data stream and the same model as the run that saved
# (every option that shapes it: two runs with other --n-head have the same shapes and
# compute another function), and the same optimizer and learning rate.
RESUME_MUST_MATCH = ("model", "seed", "global_batch_size", "seq_len", "n_layer", "d_model", "n_head", "mlp_width",
                     "mlp_layers", "optimizer", "lr")
# Options of the optimisation that a resumed run may change; each change is printed.
RESUME_MAY_CHANGE = ("weight_decay", "max_grad_norm", "momentum", "dtype", "grad_accum_steps", "loss_scale_window",
                     "bucket_mb", "prefetch_mb", "offload", "offload_dir", "dpu", "node_size", "qwz", "qwz_block",
                     "hpz", "qgz")


def batch(config: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (inputs, targets) for ``step``; depends only on (seed, step).

    GPT: int64 tokens and targets, [global_batch_size, seq_len]; MLP: fp32 inputs and
    targets, [global_batch_size, mlp_width].
    """
    if config.model == "gpt":
        return data.gpt_batch(step, config.global_batch_size, config.seq_len, config.seed)
    return data.mlp_batch(step, config.global_batch_size, config.mlp_width, config.seed)


def loss_fn(config: TrainConfig, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean loss in fp32 (cross-entropy over bytes, or MSE for the MLP); a 0-d tensor."""
    if config.model == "gpt":
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())
    return F.mse_loss(out.float(), y)


def build(config: TrainConfig) -> torch.nn.Module:
    """The run's model on CPU, initialised from ``config.seed`` (same on every rank)."""
    return build_model(config.model, config.seed, mlp_width=config.mlp_width, mlp_layers=config.mlp_layers,
                       gpt=GPTConfig(seq_len=config.seq_len, n_layer=config.n_layer, n_head=config.n_head,
                                     d_model=config.d_model))


def snapshot_path(path: str, rank: int, world_size: int) -> str:
    """``--cuda-memory-snapshot`` FILE for ``rank``: unchanged on one rank, ``_rankR`` added otherwise."""
    if world_size == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_rank{rank}{ext}"


@dataclass
class Run:
    """One rank's training run: its configuration, process group, engine and ZeRO-R setup."""

    config: TrainConfig
    ctx: zdist.DistContext
    engine: Engine
    zero_r: residual_setup.Residual
    first_step: int  # where this process starts: 0, or the resumed checkpoint's step


@dataclass
class Watched:
    """What the last step measured (the memory ledger slows every operator, so it watches one step)."""

    ledger: MemoryLedger | None = None
    grads_bytes: int = 0  # gradients held after backward (bytes)
    checkpoints: tuple[int, int] = (0, 0)  # (device, host) checkpoint bytes at the end of forward
    activations: int = 0  # activation bytes alive at the end of forward
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def setup(config: TrainConfig, engine_factory=make_engine) -> Run:
    """Check ``config`` on this world, agree with the other ranks, build model and engine, resume.

    ``engine_factory(stage, model, **options)`` builds the engine (default: the
    package's, :func:`zerolearn.engines.make_engine`); an engine written to the
    contract of :class:`zerolearn.engines.Engine` trains in the same loop.

    Raises:
        ConfigError: bad options (on every rank alike, before any collective), ranks
            started with different options, or ``steps`` below the checkpoint's step.
    """
    ctx = zdist.context()
    config.validate(ctx.world_size)
    if ctx.world_size > 1 and not config.simulate_world_size:
        # Before any other collective (and before debug mode, which would pair its
        # fingerprint exchanges with another rank's plain collectives).
        agree.check_same_config(config.as_dict())
        if config.checkpoint_dir:
            agree.check_shared_dir(config.checkpoint_dir, ctx.rank)
    if config.debug_collectives:
        comm.set_debug(True)
    model = build(config).to(ctx.device)
    zero_r = residual_setup.apply(config, model)  # tensor parallelism, checkpoint store
    groups = zero_r.groups
    engine = engine_factory(config.stage, model, optimizer=config.optimizer, lr=config.lr,
                            momentum=config.momentum, weight_decay=config.weight_decay, dtype=config.dtype,
                            bucket_mb=config.bucket_mb, max_grad_norm=config.max_grad_norm, group=groups.dp_group,
                            mp_group=groups.mp_group if groups.nm > 1 else None,
                            **offload_options(config), **prefetch_options(config), **zeropp_options(config))
    engine.scaler.growth_interval = config.loss_scale_window
    first = checkpoint.resume(engine, config.checkpoint_dir, config.as_dict(), RESUME_MUST_MATCH, RESUME_MAY_CHANGE)
    if first > config.steps:  # equal is a finished run started again: nothing left, exit 0
        raise ConfigError(f"--steps {config.steps}: the checkpoint in {config.checkpoint_dir} is at step {first} "
                          f"already; allowed: --steps {first} or more")
    return Run(config, ctx, engine, zero_r, first)


def offload_options(config: TrainConfig) -> dict:
    """The engine's offload keywords for ``config`` (none when it does not offload, so an
    ``engine_factory`` that knows no offload still builds the plain engine)."""
    if config.offload is None:
        return {}
    return {"offload": config.offload, "offload_dir": config.offload_dir, "dpu": config.dpu}


def prefetch_options(config: TrainConfig) -> dict:
    """ZeRO-3's ``prefetch_mb`` when set (other stages prefetch nothing; an ``engine_factory``
    that knows no such option still builds its engine with the default)."""
    return {"prefetch_mb": config.prefetch_mb} if config.stage == 3 and config.prefetch_mb is not None else {}


def zeropp_options(config: TrainConfig) -> dict:
    """The stage-3 engine's ZeRO++ keywords for ``config`` (arXiv 2306.10209 Sec 3;
    :class:`zerolearn.engines.zeropp_units.ZeroPP`): ``qwz_block`` with ``--qwz``,
    ``node_ranks`` and ``hpz`` / ``qgz`` with ``--hpz`` / ``--qgz``. None when no option is
    on, so an ``engine_factory`` that knows no ZeRO++ still builds its engine; a node size
    alone changes no collective, only how the ledger splits bytes (:func:`zerolearn.comm.set_nodes`)."""
    options = {"qwz_block": config.qwz_block} if config.qwz else {}
    if config.hpz or config.qgz:
        options.update(node_ranks=config.node_size, hpz=config.hpz, qgz=config.qgz)
    return options


def offload_entry(run: Run) -> dict:
    """The report's ``offload``: per rank, the bytes held by location at the end of the run
    (:meth:`Engine.model_state_bytes_by_location`; gradients dropped by ``zero_grad``
    except the host's buffers) and the disk I/O since the last step began
    (:meth:`Engine.offload_stats`: a checkpoint saved after it, and DPU's final publish,
    included), beside :func:`zerolearn.memory.model.offload_state_bytes` (Psi unpadded,
    gradients as held after backward). A collective."""
    from zerolearn.memory.model import offload_state_bytes, optimizer_k

    c, engine = run.config, run.engine
    mine = {"rank": run.ctx.rank, "bytes_by_location": engine.model_state_bytes_by_location(),
            "io": engine.offload_stats()}
    ranks = [mine] if run.ctx.backend == "fake" else comm.gather_objects(mine)
    k = optimizer_k(c.optimizer, "bf16", momentum=c.momentum > 0)  # the master is always its own tensor
    return {"kind": c.offload, "dpu": c.dpu, "ranks": ranks,
            "analytic": offload_state_bytes(engine.psi, run.zero_r.groups.nd, c.stage, c.offload, c.dtype, k)}


ACCUMULATE = ("last", "each", "no_sync")


def step_engine(engine: Engine, micro_batches, loss_of, *, accumulate: str = "last", phase=None,
                after_forward=None, before_step=None) -> tuple[float, bool]:
    """The training step every engine loop of the package runs: K micro-batches, one update.

    For each micro-batch ``(x, y)``: ``loss = loss_of(engine(x), y)``, then
    ``engine.backward(loss / K)``, so the gradients sum to those of the mean over the
    K micro-batches; then ``engine.step()`` and ``engine.zero_grad()``. The named
    variations:

    * ``accumulate``: which backwards reduce. ``"last"``: only the last
      (``sync=False`` before it; one reduction per step, the full gradient held until
      then); ``"each"``: every backward reduces and adds to the reduced gradient, as a
      PyTorch user writes K backwards (stages 2-3 keep only their shard meanwhile);
      ``"no_sync"``: as ``"last"``, written with ``engine.no_sync()`` as with DDP.
    * ``phase(name)``: a context manager around ``"forward"`` (with the loss),
      ``"backward"`` and ``"step"`` (memory-ledger phases, profiler labels); None: none.
    * ``after_forward(i, loss)`` after each forward, ``before_step()`` after the last
      backward: what a caller measures there (None: nothing).

    Args:
        micro_batches: a sequence of ``(x, y)``, K >= 1 of them.
        loss_of: ``(output, y) -> 0-d tensor``.

    Returns:
        (the mean loss over the micro-batches, a float; whether the optimizer stepped:
        False when fp16's loss scaler skipped an overflow).

    Raises:
        ConfigError: ``accumulate`` is not one of :data:`ACCUMULATE`.
    """
    if accumulate not in ACCUMULATE:
        raise ConfigError(f"accumulate={accumulate!r}: allowed are {', '.join(ACCUMULATE)}")
    phase = phase or (lambda name: contextlib.nullcontext())
    k, local = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        with phase("forward"):
            loss = loss_of(engine(x), y)
        if after_forward is not None:
            after_forward(i, loss)
        last = i == k - 1
        with phase("backward"):
            if accumulate == "no_sync" and not last:
                with engine.no_sync():
                    engine.backward(loss / k)
            else:
                engine.backward(loss / k, sync=last or accumulate == "each")
        local += loss.item() / k
        del loss
    if before_step is not None:
        before_step()
    with phase("step"):
        stepped = engine.step()  # True, or an overflow flag still on the device
        engine.zero_grad()
    return local, bool(stepped)  # read once, after the step


def train_step(run: Run, step: int, watched: Watched | None) -> tuple[float, bool]:
    """One optimizer step on this rank's slice of ``step``'s global batch (:func:`step_engine`
    over ``grad_accum_steps`` micro-batches, only the last reducing).

    With ``watched``, records the residual states held at the end of the first forward,
    the gradient bytes held after backward, and the ledger's phases.

    Returns (this rank's mean loss, whether the optimizer stepped: False when fp16's
    loss scaler skipped an overflow).
    """
    groups = run.zero_r.groups  # tensor-parallel ranks of one group share their data-parallel slice
    x, y = (data.rank_slice(t, groups.dp_rank, groups.nd).to(run.ctx.device) for t in batch(run.config, step))
    k = run.config.grad_accum_steps
    ledger = watched.ledger if watched else None

    def after_forward(i: int, loss) -> None:
        if watched and i == 0:  # residual states as held at the end of forward
            store = run.zero_r.store
            watched.checkpoints = store.bytes_held() if store else (0, 0)
            watched.activations = ledger.live["activations"]

    def before_step() -> None:
        fail_on_purpose(run.config, step, run.ctx.rank)  # gradients reduced, step not taken
        if watched:
            watched.grads_bytes = run.engine.model_state_bytes()["grads"]  # as held after backward

    micro = list(zip(x.chunk(k), y.chunk(k), strict=True))
    return step_engine(run.engine, micro, lambda out, t: loss_fn(run.config, out, t),
                       phase=ledger.phase if ledger is not None else None, after_forward=after_forward,
                       before_step=before_step)


def maybe_save(run: Run, done: int) -> None:
    """Save a checkpoint after ``done`` steps if ``checkpoint_every`` or the run's end says so."""
    c = run.config
    if c.checkpoint_dir and (done == c.steps or c.checkpoint_every and done % c.checkpoint_every == 0):
        # Offload: no DPU step in flight, and disk's optimizer states read in while saved.
        with run.engine.offload_resident() if hasattr(run.engine, "offload_resident") else contextlib.nullcontext():
            check_finite_params(run.engine, done - 1)
            checkpoint.save(run.engine, c.checkpoint_dir, done, extra={"config": saved_config(c)},
                            keep=c.checkpoint_keep or None)


def _steps(run: Run, progress: bool):
    steps = range(run.first_step, run.config.steps)
    if progress and run.ctx.rank == 0:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"stage {run.config.stage}", unit="step", initial=run.first_step,
                     total=run.config.steps)
    return steps


def train(config: TrainConfig, progress: bool = False, engine_factory=make_engine) -> dict:
    """Train on the current process group; every rank returns the same report
    (docs/ARCHITECTURE.md, "The training run").

    Call after :func:`zerolearn.dist.init` (or through :func:`zerolearn.dist.launch`).
    Each step: this rank's slice of the global batch, forward and backward with
    accumulation (:func:`train_step`), the engine's step, the global mean loss, a
    checkpoint when due; the last step runs under the memory ledger.

    Raises:
        ConfigError: bad options, on every rank alike, before any collective.
        zerolearn.faults.NonFiniteError: the loss or parameters became NaN or inf.
    """
    run = setup(config, engine_factory)
    cuda = run.ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(run.ctx.device)
        if config.cuda_memory_snapshot:
            compat.record_cuda_memory_history(True)
    previous_nodes = comm.node_ranks()
    comm.set_nodes(config.node_size)  # None: no split by link (the report then has none)
    try:
        comm.LEDGER.reset()
        record, steps = Watched(), _steps(run, progress)
        for step in steps:
            watched = record if step == config.steps - 1 else None
            if watched:
                record.ledger = MemoryLedger(record_timeline=config.memory_timeline)
            t0 = time.perf_counter()
            with record.ledger if watched else contextlib.nullcontext():
                if watched:
                    record.ledger.track_engine(run.engine)
                local, stepped = train_step(run, step, watched)
            if cuda:
                torch.cuda.synchronize(run.ctx.device)
            record.seconds.append(time.perf_counter() - t0)
            record.losses.append(comm.monitor_mean(local))
            check_finite(record.losses[-1], run.engine.scaler.enabled and not stepped, step)
            if hasattr(steps, "set_postfix"):
                steps.set_postfix(loss=f"{record.losses[-1]:.4f}")
            maybe_save(run, step + 1)
        if config.offload is not None:
            run.engine.finish_dpu()  # DPU: the last update lands in the working parameters
        if cuda and config.cuda_memory_snapshot:
            compat.dump_cuda_memory_snapshot(snapshot_path(config.cuda_memory_snapshot, run.ctx.rank,
                                                           run.ctx.world_size))
            compat.record_cuda_memory_history(False)
        report = make_report(run, record)
        if config.offload is not None:
            report["offload"] = offload_entry(run)
        return report
    finally:
        run.engine.close()  # hooks, masters, optimizer state, the disk files, the DPU thread
        comm.set_nodes(previous_nodes)


def train_here(config: TrainConfig, progress: bool = False) -> dict:
    """Join this process's group, train, leave: :func:`train` outside :func:`zerolearn.dist.launch`.

    The group is torchrun's (its environment variables), a simulated world
    (``config.simulate_world_size``), or this process alone (world size 1). The group
    is torn down however training ends.

    Raises:
        ConfigError, zerolearn.dist.RendezvousError: as :func:`zerolearn.dist.init` and :func:`train`.
    """
    zdist.init(config.backend, config.device, config.timeout, config.simulate_world_size)
    try:
        report = train(config, progress)
    except BaseException:
        zdist.teardown(clean=False)
        raise
    zdist.teardown()
    return report
