"""The training loop and its command line: one job, any stage, any world size.

    python -m zerolearn.train --stage 2 --steps 20 --report run.json           # 1 rank
    torchrun --nproc-per-node 4 -m zerolearn.train --stage 3 --report run.json  # 4 ranks

Every rank builds the same model from ``--seed`` and, at each step, the same global
batch from (seed, step); rank r trains on its slice. So a run's losses depend on
neither the stage nor the world size, which is what lets the book compare them.

``--report PATH`` makes rank 0 write the JSON report of DESIGN section 4: the global
mean loss per step, and per rank the model-state bytes measured from the tensors it
holds and the traffic its collectives moved, beside the paper's formulas for the
same run. Exit codes: 0 done, 2 bad arguments or a checkpoint folder another job
holds (before any work), 1 failure (naming the rank), 130 interrupted (Ctrl-C).

Failures. With ``--checkpoint-dir D`` the run saves sharded checkpoints (every
``--checkpoint-every K`` steps and at the end) and, when started again, resumes from
the newest complete one in D: ``--steps`` stays the run's total, so a resumed process
runs the remaining steps and its report's ``first_step`` says where its ``losses``
begin. Under ``torchrun --max-restarts 1`` a rank that dies makes torchrun restart
every rank, which resume from the last checkpoint (the stage and world size may
differ from the saving run's: checkpoints reshard; a checkpoint that fails its
checksums is skipped for the newest one that verifies, with a line saying so).
A step whose global loss is NaN or inf (other than an fp16 step that the loss scaler
skipped) stops the run with exit code 1, naming the step, and no checkpoint of the
broken state is written. ``--fail-at-step K --fail-rank R``
kills (or hangs) rank R during step K on the first attempt only, to test exactly that.

    torchrun --nproc-per-node 2 --max-restarts 1 \\
        -m zerolearn.train --stage 3 --steps 20 --checkpoint-dir ckpt --checkpoint-every 5 \\
        --fail-at-step 12 --fail-rank 1

(torchrun's workers share its rendezvous store across restarts. A restarted gloo rank
that reads a peer's address left by the failed attempt fails with "Gloo
connectFullMesh failed ... Connection refused": on torch 2.13, 6 of 8 restarts of a
job like this one did when all attempts used the same keys. :func:`zerolearn.dist.init`
gives each attempt a key prefix of its own. Compare pytorch/pytorch#135712, the same
stale-store problem with NCCL.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

from zerolearn import agree, checkpoint, comm, compat, data
from zerolearn import dist as zdist
from zerolearn.checkpoint import lock as checkpoint_lock
from zerolearn.dist import ConfigError
from zerolearn.engines import make_engine
from zerolearn.memory import model as analytic
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.models import MODELS, GPTConfig, build_model
from zerolearn.precision import DTYPES
from zerolearn.residual import setup as residual_setup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerolearn.train", description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=range(4), default=0, help="0 DP, 1 P_os, 2 P_os+g, 3 P_os+g+p")
    p.add_argument("--model", choices=MODELS, default="gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=16, help="sequences (or rows) per step, all ranks")
    p.add_argument("--seq-len", type=int, default=64, help="GPT context length, bytes")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (0: plain SGD, K=0 in fp32)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=0.25, help="gradient bucket size, MiB")
    p.add_argument("--grad-accum-steps", type=int, default=1, help="micro-batches per step")
    p.add_argument("--n-layer", type=int, default=2, help="GPT transformer blocks")
    p.add_argument("--d-model", type=int, default=64, help="GPT width")
    p.add_argument("--n-head", type=int, default=4, help="GPT attention heads")
    p.add_argument("--mlp-width", type=int, default=256, help="MLP width (the seed experiment: 10000)")
    p.add_argument("--mlp-layers", type=int, default=6)
    p.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--timeout", type=float, default=zdist.DEFAULT_TIMEOUT_S, help="collective timeout, s")
    p.add_argument("--simulate-world-size", type=int, default=None, metavar="N",
                   help="run rank 0 of N ranks in this process (fake process group): real shards "
                        "and bytes, no data moved, losses not meaningful")
    p.add_argument("--memory-timeline", action="store_true",
                   help="add the last step's memory timeline to the report")
    p.add_argument("--cuda-memory-snapshot", default=None, metavar="FILE",
                   help="CUDA: record every allocation of the run and write torch's memory snapshot "
                        "(open it at pytorch.org/memory_viz); one file per rank: FILE with _rankR added")
    p.add_argument("--checkpoint-dir", default=None, metavar="D",
                   help="save sharded checkpoints here; resume from the newest complete one")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save every K steps (0: only at the end); needs --checkpoint-dir")
    p.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept (0: all)")
    p.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: clean steps after which the loss scale doubles")
    p.add_argument("--debug-collectives", action="store_true",
                   help="before every collective, check that all ranks are about to run the same one "
                        "(also ZEROLEARN_DEBUG_COLLECTIVES=1)")
    p.add_argument("--fail-at-step", type=int, default=None, metavar="K",
                   help="testing: --fail-rank fails during step K, on the first attempt only")
    p.add_argument("--fail-rank", type=int, default=0, help="testing: the rank that fails")
    p.add_argument("--fail-mode", choices=("kill", "hang"), default="kill",
                   help="testing: SIGKILL itself, or stop responding")
    residual_setup.add_options(p)
    p.add_argument("--report", default=None, help="write the JSON report here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts >= 1, finite positive reals, a width the heads divide, a sequence the
    corpus holds. Raises ConfigError naming the option and what is allowed."""
    positive = {"--steps": args.steps, "--global-batch-size": args.global_batch_size,
                "--seq-len": args.seq_len, "--grad-accum-steps": args.grad_accum_steps,
                "--loss-scale-window": args.loss_scale_window, "--n-layer": args.n_layer,
                "--d-model": args.d_model, "--n-head": args.n_head, "--mlp-width": args.mlp_width,
                "--mlp-layers": args.mlp_layers}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} {value}: must be >= 1")
    reals = {"--lr": args.lr, "--timeout": args.timeout, "--bucket-mb": args.bucket_mb,
             "--max-grad-norm": args.max_grad_norm}
    for name, value in reals.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} {value}: must be a finite number > 0")
    for name, value in {"--momentum": args.momentum, "--weight-decay": args.weight_decay}.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name} {value}: must be a finite number >= 0")
    if args.model == "gpt" and args.d_model % args.n_head:
        raise ConfigError(f"--d-model {args.d_model} is not divisible by --n-head {args.n_head}; allowed are "
                          f"head counts that divide the width")
    longest = int(0.9 * len(data.corpus())) - 2  # the training split (data.gpt_batch)
    if args.model == "gpt" and args.seq_len > longest:
        raise ConfigError(f"--seq-len {args.seq_len}: longer than the training corpus; allowed are 1 to {longest}")


def _check_paths(args: argparse.Namespace) -> None:
    """Output paths that training would only fail on at its end are checked first."""
    if args.report:
        parent = os.path.dirname(os.path.abspath(args.report))
        if os.path.isdir(args.report) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"--report {args.report}: cannot write a file there (the folder must exist "
                              "and be writable)")
    if args.checkpoint_dir:
        d = os.path.abspath(args.checkpoint_dir)
        while not os.path.exists(d):  # the nearest folder that exists must be writable
            d = os.path.dirname(d)
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: not a writable folder ({d})")


def step_bytes_lower_bound(args: argparse.Namespace, nd: int) -> int:
    """Bytes one training step needs at the least on each rank, beyond the model.

    Every rank makes the whole global batch and keeps its share: GPT tokens and
    targets as int64 (2 x global batch x seq_len x 8 bytes), MLP inputs and targets
    as fp32 (global batch x width x 4 x 2). A micro-batch of ``global / (Nd x K)``
    samples (K = --grad-accum-steps) then keeps its fp32 activations: for the GPT
    12 x b x s x h per block, b x s x h with checkpointing (Sec 3.2,
    ``memory.model.activation_bytes``) plus logits and their gradient (2 x b x s x
    vocab); for the MLP its width per layer, twice. An estimate from below: a
    step that needs more than this will not run where this does not fit.
    """
    micro = max(args.global_batch_size // (nd * args.grad_accum_steps), 1)
    if args.model == "gpt":
        batch = 2 * args.global_batch_size * args.seq_len * 8
        acts = analytic.activation_bytes(args.d_model, micro, args.seq_len, args.n_layer, bytes_per_value=4,
                                         checkpointing=args.checkpoint_activations)
        return batch + acts + 2 * micro * args.seq_len * GPTConfig.vocab_size * 4
    batch = 2 * args.global_batch_size * args.mlp_width * 4
    return batch + 2 * micro * args.mlp_width * args.mlp_layers * 4


def _check_batch_fits(args: argparse.Namespace, nd: int) -> None:
    """Refuse a batch that cannot fit in this machine's memory, before allocating it
    (too large a batch otherwise ends in an allocator abort or the kernel's OOM killer)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not every platform says
        return
    need = step_bytes_lower_bound(args, nd)
    if need > free:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size}: one step needs at least {need / 2**30:.1f} GiB on each "
            f"rank (the batch, and the activations of a micro-batch of "
            f"{max(args.global_batch_size // (nd * args.grad_accum_steps), 1)}), more than the "
            f"{free / 2**30:.1f} GiB of memory free here; allowed: a smaller --global-batch-size (more "
            f"--grad-accum-steps shrinks the activations, not the batch)")


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Refuse bad input and combinations before any work; ConfigError names the option."""
    _check_numbers(args)
    _check_paths(args)
    for name, value in {"--checkpoint-every": args.checkpoint_every, "--checkpoint-keep": args.checkpoint_keep}.items():
        if value < 0:
            raise ConfigError(f"{name} {value}: must be >= 0")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir and getattr(args, "tensor_parallel", 1) > 1:
        raise ConfigError(f"--checkpoint-dir with --tensor-parallel {args.tensor_parallel}: checkpoints hold "
                          "data-parallel shards of whole layers; tensor-parallel slices are not saved (allowed: "
                          "--tensor-parallel 1 with checkpoints)")
    if args.checkpoint_dir and args.simulate_world_size:
        raise ConfigError("--checkpoint-dir with --simulate-world-size: only rank 0 exists, there is "
                          "nothing whole to save")
    if args.fail_at_step is not None and not 0 <= args.fail_rank < world_size:
        raise ConfigError(f"--fail-rank {args.fail_rank}: allowed are 0 to {world_size - 1} (world size {world_size})")
    nd = residual_setup.validate(args, world_size)  # data-parallel ranks (world / Nm)
    if args.global_batch_size % (nd * args.grad_accum_steps):
        ranks = f"world size {world_size}" if nd == world_size else f"Nd = {nd} data-parallel groups"
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by {ranks} "
            f"x --grad-accum-steps {args.grad_accum_steps}; allowed are multiples "
            f"of {nd * args.grad_accum_steps}")
    _, device = zdist.resolve_backend_device(args.backend, args.device)
    _check_batch_fits(args, nd)
    if args.cuda_memory_snapshot and device != "cuda":
        raise ConfigError(f"--cuda-memory-snapshot {args.cuda_memory_snapshot}: needs a CUDA device; "
                          f"this run is on {device} (on CPU, --memory-timeline records the step instead)")


def snapshot_path(path: str, rank: int, world_size: int) -> str:
    """``--cuda-memory-snapshot`` FILE for ``rank``: unchanged on one rank, ``_rankR`` added otherwise."""
    if world_size == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_rank{rank}{ext}"


def batch(args, step: int):
    """Global (inputs, targets) for ``step``; depends only on (seed, step)."""
    if args.model == "gpt":
        return data.gpt_batch(step, args.global_batch_size, args.seq_len, args.seed)
    return data.mlp_batch(step, args.global_batch_size, args.mlp_width, args.seed)


def loss_fn(args, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean loss in fp32 (cross-entropy over bytes, or MSE for the MLP)."""
    if args.model == "gpt":
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())
    return F.mse_loss(out.float(), y)


def analytic_bytes(args, psi: int, nd: int) -> dict[str, float]:
    """The paper's model-state bytes per rank for this run (Sec 5, Fig 1)."""
    k = analytic.optimizer_k(args.optimizer, args.dtype, momentum=args.momentum > 0)
    width = analytic.dtype_bytes(args.dtype)
    states = analytic.model_state_bytes(psi, nd, args.stage, k=k, param_bytes=width, grad_bytes=width)
    return {key: states[key] for key in ("params", "grads", "optimizer_states")}


# A resumed run must see the same data stream and model as the run that saved.
RESUME_MUST_MATCH = ("model", "seed", "global_batch_size", "seq_len", "mlp_width", "optimizer", "lr")


def say(line: str) -> None:
    """Write a message and its newline to stderr in one system call, so messages from
    ranks sharing the launcher's pipe never interleave (``print`` writes the text and
    the newline separately; a pipe keeps a single write under 4 KiB whole)."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def fail_on_purpose(args, step: int, rank: int) -> None:
    """``--fail-at-step``: kill or hang this rank, on the first attempt only.

    torchrun counts restarts in TORCHELASTIC_RESTART_COUNT (absent outside torchrun:
    every run is a first attempt).
    """
    if step != args.fail_at_step or rank != args.fail_rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    say(f"rank {rank}: failing on purpose in step {step} ({args.fail_mode})")
    if args.fail_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # "hang": alive, but never reaching the next collective
        time.sleep(3600)


class NonFiniteError(RuntimeError):
    """The training state became NaN or inf: the run stops rather than save or report it."""


def check_finite(loss: float, skipped: bool, step: int) -> None:
    """Raise NonFiniteError if the global ``loss`` of ``step`` is NaN or inf.

    ``skipped``: fp16's dynamic loss scaler skipped this step (an overflow, expected
    and allowed). Every rank sees the same global loss, so every rank raises alike
    (no collective is left waiting).
    """
    if not math.isfinite(loss) and not skipped:
        raise NonFiniteError(f"step {step}: the global mean loss is {loss}; stopping without saving a "
                             "checkpoint of this state (is --lr too high?)")


def check_finite_params(engine, step: int) -> None:
    """Raise NonFiniteError (on every rank) if any rank's fp32 master holds NaN or inf.

    Called before a checkpoint of the state after ``step`` is saved (one collective):
    an update can break the parameters while the loss before it was finite.
    """
    broken = any(not torch.isfinite(g.master).all().item() for g in engine.groups)
    if comm.monitor_mean(float(broken)) > 0:
        raise NonFiniteError(f"step {step}: its update made parameters NaN or inf; stopping without saving "
                             "a checkpoint of this state (is --lr too high?)")


def _phase(ledger: MemoryLedger | None, name: str):
    return ledger.phase(name) if ledger is not None else contextlib.nullcontext()


def train(args: argparse.Namespace, progress: bool = False) -> dict:
    """Train on the current process group; every rank returns the same report.

    Call after :func:`zerolearn.dist.init`. Raises ConfigError for bad arguments
    (on every rank alike, before any collective).
    """
    ctx = zdist.context()
    validate(args, ctx.world_size)
    if ctx.world_size > 1 and not args.simulate_world_size:
        # Before any other collective (and before debug mode, which would pair its
        # fingerprint exchanges with another rank's plain collectives).
        agree.check_same_config(vars(args))
        if args.checkpoint_dir:
            agree.check_shared_dir(args.checkpoint_dir, ctx.rank)
    if args.debug_collectives:
        comm.set_debug(True)
    model = build_model(args.model, args.seed, mlp_width=args.mlp_width, mlp_layers=args.mlp_layers,
                        gpt=GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                                      d_model=args.d_model)).to(ctx.device)
    zero_r = residual_setup.apply(args, model)  # tensor parallelism, checkpoint store
    nd, dp_rank = zero_r.groups.nd, zero_r.groups.dp_rank
    engine = make_engine(args.stage, model, optimizer=args.optimizer, lr=args.lr, momentum=args.momentum,
                         weight_decay=args.weight_decay, dtype=args.dtype, bucket_mb=args.bucket_mb,
                         max_grad_norm=args.max_grad_norm, group=zero_r.groups.dp_group,
                         model_parallel_group=zero_r.groups.tp_group if zero_r.groups.nm > 1 else None)
    engine.scaler.growth_interval = args.loss_scale_window
    first = checkpoint.resume(engine, args.checkpoint_dir, vars(args), RESUME_MUST_MATCH)
    if first > args.steps:  # equal is a finished run started again: nothing left, exit 0
        raise ConfigError(f"--steps {args.steps}: the checkpoint in {args.checkpoint_dir} is at step {first} "
                          f"already; allowed: --steps {first} or more")
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
        if args.cuda_memory_snapshot:
            compat.record_cuda_memory_history(True)
    comm.LEDGER.reset()
    losses, times, grads_bytes, ledger = [], [], 0, None
    held_checkpoints, activations = (0, 0), 0
    config = {k: v for k, v in vars(args).items() if k != "quiet"}
    steps = range(first, args.steps)
    if progress and ctx.rank == 0:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc=f"stage {args.stage}", unit="step", initial=first, total=args.steps)
    for step in steps:
        last = step == args.steps - 1
        # The ledger watches the last step only: it slows every operator down.
        ledger = MemoryLedger(record_timeline=args.memory_timeline) if last else None
        t0 = time.perf_counter()
        with ledger or contextlib.nullcontext():
            if ledger is not None:
                ledger.track_engine(engine)
            # Tensor-parallel ranks of one group share their data-parallel slice.
            x, y = (data.rank_slice(t, dp_rank, nd).to(ctx.device) for t in batch(args, step))
            local = 0.0
            for i, (xm, ym) in enumerate(zip(x.chunk(args.grad_accum_steps), y.chunk(args.grad_accum_steps))):
                with _phase(ledger, "forward"):
                    loss = loss_fn(args, engine(xm), ym)
                if last and i == 0:  # residual states as held at the end of forward
                    held_checkpoints = zero_r.store.bytes_held() if zero_r.store else (0, 0)
                    activations = ledger.live["activations"]
                with _phase(ledger, "backward"):
                    # Each micro-batch is 1/accum of the step's batch: scale so the sum is the mean.
                    engine.backward(loss / args.grad_accum_steps, sync=i == args.grad_accum_steps - 1)
                local += loss.item() / args.grad_accum_steps
                del loss
            fail_on_purpose(args, step, ctx.rank)  # gradients reduced, step not taken
            if last:
                grads_bytes = engine.model_state_bytes()["grads"]  # as held after backward
            with _phase(ledger, "step"):
                stepped = engine.step()
                engine.zero_grad()
        if cuda:
            torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - t0)
        losses.append(comm.monitor_mean(local))
        check_finite(losses[-1], engine.scaler.enabled and not stepped, step)
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{losses[-1]:.4f}")
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or args.checkpoint_every and done % args.checkpoint_every == 0):
            check_finite_params(engine, step)
            checkpoint.save(engine, args.checkpoint_dir, done, extra={"config": config},
                            keep=args.checkpoint_keep or None)
    if cuda and args.cuda_memory_snapshot:
        compat.dump_cuda_memory_snapshot(snapshot_path(args.cuda_memory_snapshot, ctx.rank, ctx.world_size))
        compat.record_cuda_memory_history(False)
    held = engine.model_state_bytes()
    memory = ledger.summary() if ledger is not None else {"peak_bytes": None}  # None: no step left to run
    if args.memory_timeline and ledger is not None:
        memory["timeline"] = [[e.index, e.phase, e.total, e.by_category] for e in ledger.timeline]
    mine = {"rank": ctx.rank,
            "model_state_bytes": {"params": held["params"], "grads": grads_bytes,
                                  "optimizer_states": held["optimizer_states"]},
            # CUDA: the allocator's peak over the run; CPU: the ledger's over the last step.
            "peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if cuda else memory["peak_bytes"],
            "memory": memory,
            "comm": comm.LEDGER.as_dict(),
            "padding_elements": engine.padding,
            "peak_grad_bytes": engine.peak_grad_bytes,
            "residual": residual_setup.report_entry(zero_r, held_checkpoints, engine.temp_buffer_peak_bytes,
                                                    activations, ctx.device),
            "comm_by_tag": comm.LEDGER.by_tag()}
    simulated = ctx.backend == "fake"
    return {"config": config,
            "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "torch": compat.TORCH_VERSION, "num_params": engine.psi, "first_step": first,
            "simulated": simulated,
            # Simulated: this process is rank 0 and the only one measured.
            "losses": losses, "ranks": [mine] if simulated else comm.gather_objects(mine),
            "data_parallel": nd, "tensor_parallel": args.tensor_parallel,
            "analytic": {"model_state_bytes": analytic_bytes(args, engine.psi, nd),
                         "residual": residual_setup.analytic_entry(args, nd)},
            "step_seconds_median": statistics.median(times) if times else 0.0}


def train_job(argv: list[str]) -> dict:
    """:func:`train` from command-line style arguments (for :func:`zerolearn.dist.launch`)."""
    return train(build_parser().parse_args(argv))


_CTRL_C = {"interrupted": False, "cleaning": False}  # main()'s SIGINT state


def _on_sigint(signum, frame) -> None:
    """SIGINT handler of :func:`main`: the first raises KeyboardInterrupt; those that
    arrive while main cleans up (torchrun passes Ctrl-C on to its workers a second
    time) are ignored, so the cleanup is not cut short by a traceback."""
    if _CTRL_C["cleaning"]:
        return
    _CTRL_C["interrupted"] = True
    raise KeyboardInterrupt


def _interrupted_step(error: BaseException) -> int | None:
    """The step :func:`train` was running when ``error`` was raised (None: no step had begun)."""
    step, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is train.__code__:
            step = tb.tb_frame.f_locals.get("step")
        tb = tb.tb_next
    return step


def _lock_checkpoint_dir(args: argparse.Namespace, ctx: zdist.DistContext) -> None:
    """Rank 0 takes ``--checkpoint-dir``'s lock for the run; every rank learns the outcome.

    One collective on a multi-rank run (rank 0 decides, the others follow, as in
    :func:`zerolearn.checkpoint.resume`), made whether or not the option is given so
    that ranks given different options still pair their collectives.

    Raises (on every rank alike):
        ConfigError: another job holds the lock (the message names the directory).
        RuntimeError: the lock cannot be taken (e.g. a full disk: OSError ENOSPC).
    """
    problem = None
    if args.checkpoint_dir and ctx.rank == 0:
        try:
            checkpoint_lock.acquire(args.checkpoint_dir)
        except checkpoint.CheckpointLockedError as e:
            problem = ("busy", f"--checkpoint-dir {e}")
        except OSError as e:
            problem = ("error", f"rank 0: cannot lock {checkpoint_lock.lock_path(args.checkpoint_dir)}: "
                                f"{type(e).__name__}: {e}")
    if ctx.world_size > 1 and ctx.backend != "fake":
        problem = comm.gather_objects(problem)[0]
    if problem is not None:
        raise (ConfigError if problem[0] == "busy" else RuntimeError)(problem[1])


def main(argv: list[str] | None = None) -> int:
    """The command line: train, write the report, print a summary (rank 0); the exit code.

    Exit codes: 0 done; 2 bad arguments, or a ``--checkpoint-dir`` that another job
    holds (before training; every rank alike); 1 a runtime failure, its message naming
    the rank (an OSError writing a checkpoint or the report, a full disk included);
    130 interrupted by Ctrl-C (SIGINT): rank 0 prints one line,
    ``interrupted (Ctrl-C) at step N``, and every rank exits without a traceback.
    The checkpoint directory's lock is released however the run ends.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _CTRL_C.update(interrupted=False, cleaning=False)
    handle = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_sigint) if handle else None
    ctx = None
    try:
        try:
            # Everything that can be checked without peers is checked before joining them.
            env = zdist.torchrun_env()
            validate(args, args.simulate_world_size or (env[1] if env else 1))
            ctx = zdist.init(args.backend, args.device, args.timeout, args.simulate_world_size)
        except ConfigError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        except zdist.RendezvousError as e:
            say(str(e))
            return 1
        try:
            _lock_checkpoint_dir(args, ctx)
            report = train(args, progress=not args.quiet)
        except ConfigError as e:
            zdist.teardown(clean=False)
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        except Exception as e:  # noqa: BLE001 - exit 1 with the rank named, as DESIGN section 4 says
            if _CTRL_C["interrupted"]:  # a peer left on Ctrl-C, failing this rank's collective
                raise KeyboardInterrupt from e
            say(f"rank {ctx.rank}: {type(e).__name__}: {e}")
            zdist.teardown(clean=False)
            return 1
        zdist.teardown()
        if ctx.rank == 0:
            if args.report:
                try:
                    with open(args.report, "w") as f:
                        json.dump(report, f, indent=1)
                except OSError as e:  # a full disk is a runtime failure (exit 1), not bad input
                    say(f"rank 0: cannot write the report {args.report}: {type(e).__name__}: {e}")
                    return 1
            losses, first = report["losses"], report["first_step"]
            if not losses:
                print(f"stage {args.stage}: nothing left to train, the checkpoint is at step {first} = --steps")
                return 0
            print(f"stage {args.stage}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"over steps {first}-{args.steps - 1} on {ctx.world_size} rank(s)"
                  f"{' (simulated: rank 0 only, losses not meaningful)' if report['simulated'] else ''}, "
                  f"{report['step_seconds_median'] * 1e3:.1f} ms/step (median)")
        return 0
    except KeyboardInterrupt as e:
        _CTRL_C["cleaning"] = True
        step = _interrupted_step(e.__cause__ or e)
        if (ctx.rank if ctx is not None else os.environ.get("RANK", "0")) in (0, "0"):
            say(f"interrupted (Ctrl-C) {'before the first step' if step is None else f'at step {step}'}")
        zdist.teardown(clean=False)
        return 130
    finally:
        _CTRL_C["cleaning"] = True
        if args.checkpoint_dir:
            checkpoint_lock.release(args.checkpoint_dir)
        if handle and previous is not None:  # None: a handler not set from Python, cannot be restored
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
