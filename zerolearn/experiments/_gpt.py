"""What the offload and ZeRO++ tables share: a small GPT, its batches, the checks of
their options, and the timed training loop (one :func:`zerolearn.train.step_engine`
per step)."""

from __future__ import annotations

import statistics
import time

import torch.nn.functional as F

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.errors import ConfigError, require_count
from zerolearn.models import GPTConfig, build_model
from zerolearn.train import step_engine

BATCH, SEQ_LEN, LR = 8, 32, 1e-2  # global batch (sequences), tokens per sequence, Adam's learning rate


def check_run(world_size: int, steps: int, d_model: int) -> None:
    """Refuse a table's options before any rank starts.

    Raises:
        ConfigError: ``world_size``, ``steps`` or ``d_model`` not an integer >= 1,
            ``d_model`` odd (2 attention heads), ``world_size`` not dividing the batch.
    """
    for name, value in (("world_size", world_size), ("steps", steps), ("d_model", d_model)):
        require_count(name, value)
    if BATCH % world_size:
        raise ConfigError(f"world_size={world_size}: must divide the global batch of {BATCH}")
    if d_model % 2:
        raise ConfigError(f"d_model={d_model}: must be even (2 attention heads)")


def small_gpt(d_model: int, n_layer: int = 2):
    """The byte-level GPT of the tables: ``n_layer`` blocks of ``d_model``, 2 heads, seed 0."""
    return build_model("gpt", 0, gpt=GPTConfig(seq_len=SEQ_LEN, n_layer=n_layer, n_head=2, d_model=d_model))


def train_steps(engine, steps: int, before_step=None) -> tuple[list[float], float]:
    """``steps`` training steps of ``engine`` on this rank's slice of each global batch.

    ``before_step(step)`` runs after each backward (what a caller measures there).
    Returns (the global mean loss per step, the median step time after the first, seconds).
    """
    ctx = zdist.context()
    losses, times = [], []
    for step in range(steps):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in data.gpt_batch(step, BATCH, SEQ_LEN, 1))
        t0 = time.perf_counter()
        local, _ = step_engine(engine, [(x, y)], lambda out, t: F.cross_entropy(out.float().flatten(0, 1), t.flatten()),
                               before_step=None if before_step is None else lambda step=step: before_step(step))
        times.append(time.perf_counter() - t0)
        losses.append(comm.monitor_mean(local))
    return losses, statistics.median(times[1:] or times)
