"""Record training steps on real ranks: stages 0-3, a bucket-size sweep, ZeRO-3 prefetch on/off.

Each rank builds the run with :func:`zerolearn.train.setup` (the training loop's own
setup), takes warm-up steps (first-call allocations and gloo's connection set-up stay
out of the record), then records steps under ``torch.profiler``: a barrier first, so
that the ranks' steps start together and their timelines share an origin (to within
the barrier's exit, tens of microseconds), then :func:`labelled_step`. The step is
:func:`zerolearn.train.step_engine` with one micro-batch, its three phases labelled.

Everything measured in time depends on the machine (and the profiler adds its own
cost to every operator); the collectives and their counts do not.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from zerolearn import comm, data, train
from zerolearn.config import TrainConfig
from zerolearn.dist import launch
from zerolearn.engines import Zero3Engine, make_engine
from zerolearn.errors import ConfigError
from zerolearn.timeline.intervals import PHASE, STEP, calls, intervals_from_events, overlap, profile_events

# The GPT of chapters 2 and 3 (Psi = 464,384; fp32 gradient 1.77 MiB), and chapter 4's
# deeper, narrower one (six ZeRO-3 units) for the prefetch comparison.
# ZeRO-3 prefetches one unit at a time here (prefetch_mb=0), the schedule of Sec 5.3.
CONFIG = TrainConfig(model="gpt", d_model=128, seq_len=16, n_layer=2, global_batch_size=12, bucket_mb=0.25,
                     prefetch_mb=0)
PREFETCH_CONFIG = TrainConfig(model="gpt", stage=3, n_layer=4, d_model=64, n_head=4, seq_len=32,
                              global_batch_size=8, bucket_mb=0.25, prefetch_mb=0)
BUCKETS_MB = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
__all__ = ["BUCKETS_MB", "CONFIG", "PREFETCH_CONFIG", "Spec", "labelled_step", "prefetch", "prefetch_specs",
           "record", "record_on_rank", "record_step", "stage_specs", "stages", "summary", "sweep", "sweep_specs"]


@dataclass(frozen=True)
class Spec:
    """One recording: a run's configuration, ZeRO-3 prefetch on or off, steps to record.

    Raises:
        ConfigError: ``prefetch=False`` below stage 3, gradient accumulation, or fewer
            than one recorded step.
    """

    name: str
    config: TrainConfig
    prefetch: bool = True
    repeats: int = 1
    warmup: int = 1

    def __post_init__(self) -> None:
        if not self.prefetch and self.config.stage != 3:
            raise ConfigError(f"prefetch=False: only ZeRO-3 prefetches (stage is {self.config.stage})")
        if self.config.grad_accum_steps != 1:
            raise ConfigError(f"--grad-accum-steps {self.config.grad_accum_steps}: the timeline records one "
                              "micro-batch per step; allowed: 1")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError(f"repeats={self.repeats}, warmup={self.warmup}: allowed repeats >= 1, warmup >= 0")


class _Zero3WithoutPrefetch(Zero3Engine):
    """ZeRO-3 gathering each unit only when its own hook runs: no neighbour is prefetched."""

    def __init__(self, model, **options):
        super().__init__(model, **options)
        self.schedule.prefetch = False


def _engine(prefetch: bool):
    if prefetch:
        return make_engine
    return lambda stage, model, **options: _Zero3WithoutPrefetch(model, **options)


def labelled_step(run: train.Run, step: int) -> None:
    """:func:`zerolearn.train.step_engine` with one micro-batch, its phases labelled for the profiler
    (``forward`` includes the loss; ``step`` is the optimizer step and ``zero_grad``)."""
    groups = run.zero_r.groups
    x, y = (data.rank_slice(t, groups.dp_rank, groups.nd).to(run.ctx.device) for t in train.batch(run.config, step))
    train.step_engine(run.engine, [(x, y)], lambda out, t: train.loss_fn(run.config, out, t),
                      phase=lambda name: comm.profiler_label(PHASE, name))


def record_step(run: train.Run, step: int, trace_path: str | None = None) -> dict:
    """Record one step on this rank: ``{"intervals": [...], "ledger": {op: {calls, elements, bytes}}}``.

    Times in seconds from this rank's step start. ``trace_path``: also write the
    profiler's Chrome trace (JSON; open it in Perfetto or chrome://tracing), every
    operator with zerolearn's labels around them.
    """
    comm.LEDGER.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        comm.barrier()
        with record_function(STEP):
            labelled_step(run, step)
    ledger = comm.LEDGER.as_dict()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return {"intervals": intervals_from_events(profile_events(prof), dist.get_rank()), "ledger": ledger}


def record_on_rank(specs: list[Spec], trace_dir: str | None = None) -> list[dict]:
    """Every spec on this rank (run inside :func:`zerolearn.dist.launch`): per spec the
    number of flat groups (buckets) and one :func:`record_step` result per recorded step.
    The last recorded step of each spec writes ``<trace_dir>/<name>_rank<r>.json``."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines on stderr
    out = []
    for spec in specs:
        run = train.setup(spec.config, _engine(spec.prefetch))
        for s in range(spec.warmup):
            labelled_step(run, s)
        steps = []
        for k in range(spec.repeats):
            last = k == spec.repeats - 1
            path = os.path.join(trace_dir, f"{spec.name}_rank{dist.get_rank()}.json") if trace_dir and last else None
            steps.append(record_step(run, spec.warmup + k, path))
        out.append({"buckets": len(run.engine.buckets), "steps": steps})
        del run
    return out


def _rounded(d: dict) -> dict:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


def summary(intervals: list[dict], world_size: int) -> list[dict]:
    """Per rank: ``step_s``, the whole step's :func:`overlap` and each phase's, calls per op."""
    out = []
    for r in range(world_size):
        step = next(i for i in intervals if i["lane"] == "step" and i["rank"] == r)
        row = {"rank": r, **_rounded({"step_s": step["end"] - step["start"], **overlap(intervals, r)}),
               "calls_by_op": calls(intervals, r)}
        row["phases"] = {p: _rounded(overlap(intervals, r, phase=p)) for p in ("forward", "backward", "step")}
        out.append(row)
    return out


def record(specs: list[Spec], world_size: int = 2, trace_dir: str | None = None,
           timeout_s: float = 600.0) -> list[dict]:
    """Record ``specs`` on ``world_size`` spawned gloo ranks (one launch for all).

    Returns one dict per spec: ``name``, ``stage``, ``bucket_mb``, ``prefetch``,
    ``buckets`` (flat groups) and ``steps``, one per recorded step, each with
    ``intervals`` (all ranks), ``ledger`` (one comm dict per rank) and ``summary``
    (:func:`summary`). Seconds throughout.
    """
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
    per_rank = launch(record_on_rank, world_size, list(specs), trace_dir, timeout_s=timeout_s)
    out = []
    for i, spec in enumerate(specs):
        steps = []
        for k in range(spec.repeats):
            intervals = [iv for r in range(world_size) for iv in per_rank[r][i]["steps"][k]["intervals"]]
            steps.append({"intervals": intervals, "ledger": [per_rank[r][i]["steps"][k]["ledger"]
                                                              for r in range(world_size)],
                          "summary": summary(intervals, world_size)})
        out.append({"name": spec.name, "stage": spec.config.stage, "bucket_mb": spec.config.bucket_mb,
                    "prefetch": spec.prefetch, "buckets": per_rank[0][i]["buckets"], "steps": steps})
    return out


def _meta(config: TrainConfig, world_size: int, what: str) -> dict:
    keep = ("model", "d_model", "n_layer", "n_head", "seq_len", "global_batch_size", "dtype", "optimizer",
            "bucket_mb", "stage")
    return {"about": what + " Times in seconds from each rank's step start, recorded with torch.profiler on gloo "
                     "(CPU); they depend on the machine, the collectives and their counts do not.",
            "world_size": world_size, "torch": torch.__version__.split("+")[0],
            "config": {k: v for k, v in config.as_dict().items() if k in keep}}


def _median_step(rec: dict) -> dict:
    """The recorded step whose slowest rank took the median time."""
    steps = sorted(rec["steps"], key=lambda s: max(r["step_s"] for r in s["summary"]))
    return steps[(len(steps) - 1) // 2]


# ----- the three experiments: specs, and the stored dicts built from their records ---
def stage_specs(config: TrainConfig = CONFIG, repeats: int = 1) -> list[Spec]:
    """``repeats`` recorded steps at each of stages 0-3 of ``config``."""
    return [Spec(f"stage{s}", config.replace(stage=s), repeats=repeats) for s in range(4)]


def stages(records: list[dict], config: TrainConfig = CONFIG, world_size: int = 2) -> dict:
    """Stored form of the stage recordings: one step per stage (the median one when
    several were recorded), every rank's intervals, ledger and summary."""
    return {**_meta(config, world_size, "One training step per stage and rank."),
            "stages": [{"stage": r["stage"], "buckets": r["buckets"], **_median_step(r)} for r in records]}


def sweep_specs(config: TrainConfig = CONFIG, stage: int = 2, buckets_mb=BUCKETS_MB, repeats: int = 3) -> list[Spec]:
    """``repeats`` recorded steps at ``stage`` for each bucket size (MiB)."""
    return [Spec(f"sweep{b}", config.replace(stage=stage, bucket_mb=b), repeats=repeats) for b in buckets_mb]


def sweep(records: list[dict], config: TrainConfig = CONFIG, world_size: int = 2,
          timelines_mb: tuple[float, ...] = (BUCKETS_MB[0], CONFIG.bucket_mb, BUCKETS_MB[-1])) -> dict:
    """Stored form of a bucket sweep: per bucket size the counts, and medians over the
    recorded steps of the step time (slowest rank), the backward reductions' overlap
    and the time blocked in waits (mean over ranks); for the bucket sizes in
    ``timelines_mb`` also the median step's ``intervals``."""
    rows = []
    for rec in records:
        per_step = [(max(r["step_s"] for r in s["summary"]),
                     statistics.mean(r["phases"]["backward"]["overlap"] for r in s["summary"]),
                     statistics.mean(r["phases"]["backward"]["wait_s"] for r in s["summary"]),
                     statistics.mean(r["wait_s"] for r in s["summary"])) for s in rec["steps"]]
        step_s, ovl, bwait, wait = (statistics.median(col) for col in zip(*per_step, strict=True))
        rows.append({"bucket_mb": rec["bucket_mb"], "buckets": rec["buckets"],
                     "calls": {op: c["calls"] for op, c in rec["steps"][0]["ledger"][0].items()},
                     **_rounded({"step_s": step_s, "backward_overlap": ovl, "backward_wait_s": bwait,
                                 "wait_s": wait})})
        if rec["bucket_mb"] in timelines_mb:
            rows[-1]["intervals"] = _median_step(rec)["intervals"]
    return {**_meta(config.replace(stage=records[0]["stage"]), world_size,
                    "A bucket-size sweep, medians over the recorded steps."), "rows": rows}


def prefetch_specs(config: TrainConfig = PREFETCH_CONFIG, repeats: int = 3) -> list[Spec]:
    """``repeats`` recorded ZeRO-3 steps with prefetch, then as many without."""
    return [Spec(f"prefetch_{'on' if on else 'off'}", config.replace(stage=3), prefetch=on, repeats=repeats)
            for on in (True, False)]


def prefetch(records: list[dict], config: TrainConfig = PREFETCH_CONFIG, world_size: int = 2) -> dict:
    """Stored form of ZeRO-3 with prefetch on and off: the median step of each, and the
    forward all_gathers' overlap with forward compute (mean over ranks, median over steps)."""
    runs = []
    for rec in records:
        per_step = [[statistics.mean(r["phases"]["forward"][k] for r in s["summary"]) for k in
                     ("overlap", "wait_s", "comm_s")] + [max(r["step_s"] for r in s["summary"])]
                    for s in rec["steps"]]
        ovl, wait, comm_s, step_s = (statistics.median(col) for col in zip(*per_step, strict=True))
        runs.append({"prefetch": rec["prefetch"], "buckets": rec["buckets"],
                     **_rounded({"forward_overlap": ovl, "forward_wait_s": wait, "forward_comm_s": comm_s,
                                 "step_s": step_s}), **_median_step(rec)})
    return {**_meta(config.replace(stage=3), world_size, "ZeRO-3 with and without prefetch (Sec 5.3)."),
            "runs": runs}
