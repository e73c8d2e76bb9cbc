"""What a training run does when something goes wrong: messages, NaN checks, injected faults.

* :func:`say` writes one line to stderr in one system call (ranks share a pipe);
* :func:`check_finite` / :func:`check_finite_params` stop a run whose loss or
  parameters became NaN or inf, before a checkpoint of that state is written;
* :func:`fail_on_purpose` kills or hangs one rank at one step (``--fail-at-step``),
  to test that the others fail within the timeout and that restarts resume.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import torch

from zerolearn import comm


def say(line: str) -> None:
    """Write a message and its newline to stderr in one system call, so messages from
    ranks sharing the launcher's pipe never interleave (``print`` writes the text and
    the newline separately; a pipe keeps a single write under 4 KiB whole)."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def fail_on_purpose(config, step: int, rank: int) -> None:
    """``--fail-at-step``: kill or hang this rank, on the first attempt only.

    torchrun counts restarts in TORCHELASTIC_RESTART_COUNT (absent outside torchrun:
    every run is a first attempt).
    """
    if step != config.fail_at_step or rank != config.fail_rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    say(f"rank {rank}: failing on purpose in step {step} ({config.fail_mode})")
    if config.fail_mode == "kill":
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
    broken = any(not torch.isfinite(g.master).all().item() for g in engine.buckets)
    if comm.monitor_mean(float(broken)) > 0:
        raise NonFiniteError(f"step {step}: its update made parameters NaN or inf; stopping without saving "
                             "a checkpoint of this state (is --lr too high?)")
