"""Chapter 4, ZeRO-3 (P_os+g+p): the runs the notebook and chapter 6 reuse.

* :func:`all_stages` trains stages 0-3 one after the other on the ranks that
  :func:`zerolearn.dist.launch` spawned (one spawn instead of four).
* :func:`simulate` is ``python -m zerolearn.train --simulate-world-size N`` run in
  this process: rank 0 of N ranks, real shards, no data moved.
"""

from __future__ import annotations

from zerolearn.config import TrainConfig
from zerolearn.train import train, train_here

__all__ = ["all_stages", "simulate"]


def all_stages(config: TrainConfig, stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    """Train each of ``stages`` in turn on this process group, otherwise with ``config``.

    Runs on every rank spawned by :func:`zerolearn.dist.launch`; returns the reports
    of :func:`zerolearn.train.train` (docs/ARCHITECTURE.md, "The training run"), one per stage, in order.
    """
    return [train(config.replace(stage=stage)) for stage in stages]


def simulate(stage: int, nd: int, config: TrainConfig) -> dict:
    """``python -m zerolearn.train --stage S --simulate-world-size ND ...`` in this process.

    This process plays rank 0 of ``nd`` ranks on torch's "fake" process group: every
    flat buffer is padded and sharded for ``nd`` ranks, so the bytes measured are
    those rank 0 of a real ``nd``-rank job would hold; collectives move no data, so
    the losses mean nothing. Returns the training report (``ranks`` holds rank 0).
    """
    return train_here(config.replace(stage=stage, simulate_world_size=nd))

