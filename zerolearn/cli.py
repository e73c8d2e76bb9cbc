"""``python -m zerolearn.train``: parse, train, write the report, and exit with a code that says how it went.

Exit codes (docs/ARCHITECTURE.md, "The training run"): 0 done; 2 bad arguments, or a ``--checkpoint-dir``
another job holds (before training; every rank alike); 1 a runtime failure, its
message naming the rank (an OSError writing a checkpoint or the report, a full disk
included); 130 interrupted by Ctrl-C (SIGINT) and 143 stopped by SIGTERM (a job
scheduler's, ``kill``'s): rank 0 prints one line naming the signal, the step and the
last complete checkpoint (``interrupted (Ctrl-C) at step N; last checkpoint:
D/step_00000040``, ``terminated (SIGTERM) at step N; ...``), and every rank exits
without a traceback. The checkpoint directory's lock is released however the run ends.

``--report PATH`` makes rank 0 write the JSON report of docs/ARCHITECTURE.md ("The training run"): the global
mean loss per step, and per rank the model-state bytes measured from the tensors it
holds and the traffic its collectives moved, beside the paper's formulas for the
same run.

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

import json
import os
import signal
import threading

from zerolearn import checkpoint, comm
from zerolearn import dist as zdist
from zerolearn import train as training
from zerolearn.checkpoint import lock as checkpoint_lock
from zerolearn.config import TrainConfig, build_parser
from zerolearn.errors import ConfigError
from zerolearn.faults import say
from zerolearn.tables import kib

_CTRL_C = {"interrupted": False, "cleaning": False, "signal": signal.SIGINT}  # main()'s SIGINT/SIGTERM state
SIGNALS = {signal.SIGINT: ("interrupted (Ctrl-C)", 130), signal.SIGTERM: ("terminated (SIGTERM)", 143)}


class _Exit(Exception):
    """Leave :func:`main` with ``code`` (after the message, if any, was written)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _on_signal(signum, frame) -> None:
    """SIGINT and SIGTERM handler of :func:`main`: the first raises KeyboardInterrupt
    (and is remembered); those that arrive while main cleans up (torchrun passes a
    signal on to its workers a second time) are ignored, so the cleanup is not cut
    short by a traceback."""
    if _CTRL_C["cleaning"]:
        return
    if not _CTRL_C["interrupted"]:
        _CTRL_C.update(interrupted=True, signal=signal.Signals(signum))
    raise KeyboardInterrupt


def last_checkpoint(config: TrainConfig) -> str:
    """Where a stopped run can resume from: the newest complete checkpoint, said in words."""
    if not config.checkpoint_dir:
        return "none (no --checkpoint-dir)"
    try:
        return checkpoint.latest(config.checkpoint_dir) or f"none yet in {config.checkpoint_dir}"
    except OSError as e:
        return f"unknown ({config.checkpoint_dir}: {e.strerror})"


def _interrupted_step(error: BaseException) -> int | None:
    """The step :func:`zerolearn.train.train` was running when ``error`` was raised (None: none had begun)."""
    step, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is training.train.__code__:
            step = tb.tb_frame.f_locals.get("step")
        tb = tb.tb_next
    return step


def _lock_checkpoint_dir(config: TrainConfig, ctx: zdist.DistContext) -> None:
    """Rank 0 takes ``--checkpoint-dir``'s lock for the run; every rank learns the outcome.

    One collective on a multi-rank run (rank 0 decides, the others follow, as in
    :func:`zerolearn.checkpoint.resume`), made whether or not the option is given so
    that ranks given different options still pair their collectives.

    Raises (on every rank alike):
        ConfigError: another job holds the lock (the message names the directory).
        RuntimeError: the lock cannot be taken (e.g. a full disk: OSError ENOSPC).
    """
    problem = None
    if config.checkpoint_dir and ctx.rank == 0:
        try:
            checkpoint_lock.acquire(config.checkpoint_dir)
        except checkpoint.CheckpointLockedError as e:
            problem = ("busy", f"--checkpoint-dir {e}")
        except OSError as e:
            problem = ("error", f"rank 0: cannot lock {checkpoint_lock.lock_path(config.checkpoint_dir)}: "
                                f"{type(e).__name__}: {e}")
    if ctx.world_size > 1 and ctx.backend != "fake":
        problem = comm.gather_objects(problem)[0]
    if problem is not None:
        raise (ConfigError if problem[0] == "busy" else RuntimeError)(problem[1])


def _refuse(message: str) -> SystemExit:
    """Exit 2 with argparse's ``prog: error: message`` line (as a bad flag does)."""
    parser = build_parser()
    try:
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    except SystemExit as e:
        return e


def _join(config: TrainConfig) -> zdist.DistContext:
    """Check what can be checked without peers, then join them (exit 2 or 1 on failure)."""
    try:
        env = zdist.torchrun_env()
        config.validate(config.simulate_world_size or (env[1] if env else 1))
        return zdist.init(config.backend, config.device, config.timeout, config.simulate_world_size)
    except ConfigError as e:
        raise _refuse(str(e)) from e
    except zdist.RendezvousError as e:
        say(str(e))
        raise _Exit(1) from e


def _train(config: TrainConfig, ctx: zdist.DistContext) -> dict:
    """Lock, train, tear down; bad input exits 2, a failure 1 naming the rank."""
    try:
        _lock_checkpoint_dir(config, ctx)
        report = training.train(config, progress=not config.quiet)
    except ConfigError as e:
        zdist.teardown(clean=False)
        raise _refuse(str(e)) from e
    except Exception as e:  # noqa: BLE001 - exit 1 with the rank named, as docs/ARCHITECTURE.md says
        if _CTRL_C["interrupted"]:  # a peer left on Ctrl-C, failing this rank's collective
            raise KeyboardInterrupt from e
        say(f"rank {ctx.rank}: {type(e).__name__}: {e}")
        zdist.teardown(clean=False)
        raise _Exit(1) from e
    zdist.teardown()
    return report


def _finish(config: TrainConfig, report: dict, world_size: int) -> None:
    """Rank 0: write the report (exit 1 if it cannot) and print the one-line summary."""
    if config.report:
        try:
            with open(config.report, "w") as f:
                json.dump(report, f, indent=1)
        except OSError as e:  # a full disk is a runtime failure (exit 1), not bad input
            say(f"rank 0: cannot write the report {config.report}: {type(e).__name__}: {e}")
            raise _Exit(1) from e
    losses, first = report["losses"], report["first_step"]
    if not losses:
        print(f"stage {config.stage}: nothing left to train, the checkpoint is at step {first} = --steps")
        return
    print(f"stage {config.stage}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"over steps {first}-{config.steps - 1} on {world_size} rank(s)"
          f"{' (simulated: rank 0 only, losses not meaningful)' if report['simulated'] else ''}, "
          f"{report['step_seconds_median'] * 1e3:.1f} ms/step (median)")
    if config.node_size is not None:
        print(link_summary(report))


def link_summary(report: dict) -> str:
    """One line per node boundary: bytes per step each rank moved inside its node and
    across nodes (the report's ``comm_by_link``, :mod:`zerolearn.comm`'s link model),
    as KiB, for the ranks measured (rank 0 only in a simulated world)."""
    steps, k = len(report["losses"]), report["node_size"]
    per_rank = ", ".join(f"rank {e['rank']} {kib(e['comm_by_link']['intra'] / steps)} / "
                         f"{kib(e['comm_by_link']['inter'] / steps)}" for e in report["ranks"])
    return (f"nodes of {k} rank(s): KiB per step intra-node / inter-node: {per_rank}")


def main(argv: list[str] | None = None) -> int:
    """The command line: train, write the report, print a summary (rank 0); the exit code (see above)."""
    config = TrainConfig.from_argv(argv)
    _CTRL_C.update(interrupted=False, cleaning=False, signal=signal.SIGINT)
    handle = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS} if handle else {}
    ctx = None
    try:
        ctx = _join(config)
        report = _train(config, ctx)
        if ctx.rank == 0:
            _finish(config, report, ctx.world_size)
        return 0
    except _Exit as e:
        return e.code
    except KeyboardInterrupt as e:
        _CTRL_C["cleaning"] = True
        what, code = SIGNALS[_CTRL_C["signal"]]
        step = _interrupted_step(e.__cause__ or e)
        if (ctx.rank if ctx is not None else os.environ.get("RANK", "0")) in (0, "0"):
            say(f"{what} {'before the first step' if step is None else f'at step {step}'}; "
                f"last checkpoint: {last_checkpoint(config)}")
        zdist.teardown(clean=False)
        return code
    finally:
        _CTRL_C["cleaning"] = True
        if config.checkpoint_dir:
            checkpoint_lock.release(config.checkpoint_dir)
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, cannot be restored
                signal.signal(sig, handler)
