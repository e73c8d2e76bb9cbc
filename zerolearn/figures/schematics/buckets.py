"""Backward's bucket schedule (Sec 5.2): layers in reverse, buckets filling and launching,
the ideal overlap beside what a recorded run measured.

The buckets are the engine's: the run's model (``zerolearn.train.build`` of the stored
config) cut by :func:`zerolearn.flat.make_buckets` in reverse registration order at the
run's ``bucket_mb``, as ``Engine._build_buckets`` cuts them for stages 0-2. The measured
side is a step stored by :mod:`zerolearn.timeline` (``notebooks/data/timeline/stages.json``):
backward's compute and each bucket's reduction from launch to completion. The ideal side is
the cost model's picture (:func:`zerolearn.costmodel.step_time` with ``overlap=1``): the same
backward compute, shared among buckets by their elements (a parameter's backward costs 4
flops per token whatever its layer), each reduction launched the moment its bucket is
complete and run back to back on one link at the bandwidth the run measured, so only what is
left after the last bucket's gradients is exposed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from zerolearn.costmodel import Hardware, Job, step_time
from zerolearn.errors import ConfigError, require_choice
from zerolearn.figures.schematics.palette import rank_color
from zerolearn.flat import bucket_caps, make_buckets
from zerolearn.memory.model import comm_collectives_elements, comm_volume_elements, stage_title

__all__ = ["BucketSchedule", "STAGES_JSON", "bucket_schedule", "bucket_schedule_figure"]

STAGES_JSON = Path(__file__).resolve().parents[3] / "notebooks" / "data" / "timeline" / "stages.json"


@dataclass(frozen=True)
class BucketSchedule:
    """One backward at one stage, in seconds from backward's start.

    Attributes:
        stage, world_size: of the recorded run. buckets: ``(first name, last name, elements)``
            in launch order (the last layers first). op: the reduction (all_reduce, reduce_scatter).
        ideal: per bucket ``(compute start, compute end, comm start, comm end)``.
        measured: per bucket ``(comm start, comm end)`` of the recorded rank, same order.
        backward_s: measured backward (first compute to last reduction's end).
        compute_s: measured backward compute; comm_s: measured reduction time (union).
    """

    stage: int
    world_size: int
    op: str
    buckets: list[tuple[str, str, int]]
    ideal: list[tuple[float, float, float, float]]
    measured: list[tuple[float, float]]
    backward_s: float
    compute_s: float
    comm_s: float


def bucket_schedule(stored: dict | None = None, stage: int = 2, rank: int = 0) -> BucketSchedule:
    """The buckets of the recorded step at ``stage`` (0-2) on ``rank``, measured and ideal.

    Args:
        stored: ``stages.json`` as stored by ``python -m zerolearn.timeline`` (default: the
            book's, :data:`STAGES_JSON`).

    Raises:
        ConfigError: a stage the file does not hold or 3 (whose buckets follow units), an
            unknown rank, or reductions that do not match the engine's buckets.
    """
    from zerolearn.config import TrainConfig
    from zerolearn.train import build

    stored = json.loads(STAGES_JSON.read_text()) if stored is None else stored
    require_choice("stage", stage, [s["stage"] for s in stored["stages"] if s["stage"] != 3])
    require_choice("rank", rank, tuple(range(stored["world_size"])))
    run = next(s for s in stored["stages"] if s["stage"] == stage)
    config = TrainConfig(**{**stored["config"], "stage": stage})
    model = build(config)
    first, cap = bucket_caps(config.bucket_mb, "cpu")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    nd = stored["world_size"]
    layouts = make_buckets(named, cap, 4 if config.dtype == "fp32" else 2, 1 if stage == 0 else nd, 0, first)
    op = "all_reduce" if stage == 0 else "reduce_scatter"
    comms = sorted((i for i in run["intervals"] if i["rank"] == rank and i["lane"] == "comm"
                    and i.get("phase") == "backward" and i["label"] == op), key=lambda i: i["start"])
    if len(comms) != len(layouts):
        raise ConfigError(f"stage {stage}: {len(comms)} recorded reductions for {len(layouts)} buckets; allowed: "
                          "a file recorded with this package's bucket policy")
    for lay, i in zip(layouts, comms, strict=True):
        if f"{lay.names[0]}..{lay.names[-1]}" not in i.get("unit", ""):
            raise ConfigError(f"recorded reduction {i.get('unit')!r} is not bucket {lay.label}")
    backward = next(i for i in run["intervals"] if i["rank"] == rank and i["lane"] == "compute"
                    and i["label"] == "backward")
    phase = next(s for s in run["summary"] if s["rank"] == rank)["phases"]["backward"]
    t0 = backward["start"]
    measured = [(i["start"] - t0, i["end"] - t0) for i in comms]
    # The cost model with the run's own costs: compute as measured, the link at the measured rate.
    psi = sum(lay.padded_numel for lay in layouts)
    share = (2 * comm_collectives_elements(1, stage)["all_reduce"] + comm_collectives_elements(1, stage)[
        "reduce_scatter"]) / comm_volume_elements(1, stage)
    volume = comm_volume_elements(psi, stage) * share * (nd - 1) / nd * (4 if config.dtype == "fp32" else 2)
    rate = volume / max(phase["comm_s"], 1e-9) / 1e9  # GB/s
    hw = Hardware(tflops_achieved=1.0, intra_node_GBps=rate, inter_node_GBps=rate, gpus_per_node=max(nd, 1))
    ideal, clock, link = [], 0.0, 0.0
    for lay in layouts:
        compute = phase["compute_s"] * lay.padded_numel / psi
        comm = step_time(Job(psi=lay.padded_numel, tokens_per_gpu=1, stage=stage, nd=nd, overlap=1.0,
                             grad_dtype="fp32" if config.dtype == "fp32" else "bf16"), hw).comm_s * share
        start = max(clock + compute, link)
        ideal.append((clock, clock + compute, start, start + comm))
        clock, link = clock + compute, start + comm
    return BucketSchedule(stage, nd, op, [(lay.names[0], lay.names[-1], lay.padded_numel) for lay in layouts],
                          ideal, measured, max(e for _, e in measured), phase["compute_s"], phase["comm_s"])


def bucket_schedule_figure(stored: dict | None = None, stage: int = 2, rank: int = 0) -> Figure:
    """Two panels on one time axis (ms): the ideal schedule (compute per bucket, its reduction
    right after) and the recorded one (each bucket's reduction, launch to end), buckets
    coloured alike in both (:func:`bucket_schedule`)."""
    s = bucket_schedule(stored, stage, rank)
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ideal_ax, measured_ax = fig.subplots(2, 1, sharex=True)
    ms = 1e3
    for b, ((c0, c1, m0, m1), (r0, r1)) in enumerate(zip(s.ideal, s.measured, strict=True)):
        color = rank_color(b)
        ideal_ax.broken_barh([(c0 * ms, (c1 - c0) * ms)], (1.1, 0.8), color=color, alpha=0.45)
        ideal_ax.broken_barh([(m0 * ms, (m1 - m0) * ms)], (0.1, 0.8), color=color)
        measured_ax.broken_barh([(r0 * ms, (r1 - r0) * ms)], (0.1 + 0.8 * (b % 2) / 2, 0.4), color=color)
    measured_ax.broken_barh([(0, s.compute_s * ms)], (1.1, 0.8), color="0.75")
    ideal_ax.set_yticks([0.5, 1.5], [s.op, "backward compute"], fontsize=7)
    measured_ax.set_yticks([0.5, 1.5], [s.op, "compute (total)"], fontsize=7)
    ideal_ax.set_title(f"ideal (cost model, overlap = 1): {len(s.buckets)} buckets, each reduced as soon as "
                       "its gradients are in", fontsize=8, loc="left")
    measured_ax.set_title(f"measured on rank {rank} of {s.world_size} gloo ranks: backward "
                          f"{s.backward_s * ms:.1f} ms, reductions {s.comm_s * ms:.1f} ms", fontsize=8, loc="left")
    measured_ax.set_xlabel("time from backward's start (ms)")
    fig.suptitle(f"Backward's bucket schedule, {stage_title(stage)}: layers in reverse, one colour per bucket",
                 fontsize=9)
    return fig
