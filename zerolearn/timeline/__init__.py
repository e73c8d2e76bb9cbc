"""Time made visible: a per-rank timeline of one training step at each stage.

The chapters count bytes and collectives exactly; this package shows *when* they
happen. One step is recorded on every rank with ``torch.profiler``, together with
the communication ledger: compute (forward, backward, the optimizer step), each
collective from launch to completion (gloo runs it on a thread of its own, so an
asynchronous one runs alongside compute) and the time the main thread waits for one.
From those intervals it measures how much communication hides behind compute (the
point of reducing buckets during backward, Sec 5.2, and of ZeRO-3's prefetch,
Sec 5.3; Sec 7 counts the volume that these times move). Definitions are in
:mod:`zerolearn.timeline.intervals`; recording in :mod:`zerolearn.timeline.runs`;
figures in :mod:`zerolearn.figures.timeline`.

    python -m zerolearn.timeline --out notebooks/data/timeline/    # the chapters' stored results

In Python::

    from zerolearn import timeline
    st = timeline.record_stages(world_size=2, trace_dir="traces/")   # Chrome traces per rank
    timeline.overlap(st["stages"][2]["intervals"], rank=0, phase="backward")["overlap"]
"""

from __future__ import annotations

from zerolearn.config import TrainConfig
from zerolearn.timeline.intervals import (
    LANES,
    calls,
    intersect,
    intervals_from_events,
    length,
    overlap,
    profile_events,
    subtract,
    union,
)
from zerolearn.timeline.runs import (
    BUCKETS_MB,
    CONFIG,
    PREFETCH_CONFIG,
    Spec,
    labelled_step,
    prefetch,
    prefetch_specs,
    record,
    record_step,
    stage_specs,
    stages,
    summary,
    sweep,
    sweep_specs,
)

FILES = {"stages": "stages.json", "sweep": "bucket_sweep.json", "prefetch": "prefetch.json"}
__all__ = ["BUCKETS_MB", "CONFIG", "FILES", "LANES", "PREFETCH_CONFIG", "Spec", "calls", "intersect",
           "intervals_from_events", "labelled_step", "length", "overlap", "prefetch", "prefetch_specs",
           "profile_events", "record", "record_all", "record_bucket_sweep", "record_prefetch", "record_stages",
           "record_step", "stage_specs", "stages", "subtract", "summary", "sweep", "sweep_specs", "union"]


def record_stages(world_size: int = 2, config: TrainConfig = CONFIG, trace_dir: str | None = None) -> dict:
    """One step at each stage 0-3 on ``world_size`` gloo ranks (seconds; stored form of
    :func:`~zerolearn.timeline.runs.stages`). ``trace_dir``: a Chrome trace per stage and rank."""
    return stages(record(stage_specs(config), world_size, trace_dir), config, world_size)


def record_bucket_sweep(world_size: int = 2, config: TrainConfig = CONFIG, stage: int = 2,
                        buckets_mb: tuple[float, ...] = BUCKETS_MB, repeats: int = 3) -> dict:
    """Step time, collectives and overlap against bucket size (MiB) at ``stage``."""
    return sweep(record(sweep_specs(config, stage, buckets_mb, repeats), world_size), config, world_size)


def record_prefetch(world_size: int = 2, config: TrainConfig = PREFETCH_CONFIG, repeats: int = 3) -> dict:
    """ZeRO-3 with and without prefetching the next unit's all_gather (Sec 5.3)."""
    return prefetch(record(prefetch_specs(config, repeats), world_size), config, world_size)


def record_all(world_size: int = 2, trace_dir: str | None = None, repeats: int = 3) -> dict[str, dict]:
    """The three recordings in one launch: ``{"stages", "sweep", "prefetch"}`` (keys of ``FILES``),
    ``repeats`` recorded steps each (the stored step is the median one)."""
    specs = [stage_specs(repeats=repeats), sweep_specs(repeats=repeats), prefetch_specs(repeats=repeats)]
    records = record([s for group in specs for s in group], world_size, trace_dir)
    a, b = len(specs[0]), len(specs[0]) + len(specs[1])
    return {"stages": stages(records[:a], CONFIG, world_size), "sweep": sweep(records[a:b], CONFIG, world_size),
            "prefetch": prefetch(records[b:], PREFETCH_CONFIG, world_size)}
