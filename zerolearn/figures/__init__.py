"""What the explorers of :mod:`zerolearn.widgets` compute and draw, without any widget.

Every function here is pure (numbers in, numbers or a matplotlib ``Figure`` out), so
tests call them directly and the built book shows each explorer's default view as a
static figure, no kernel needed. The numbers come from the paper's formulas in
:mod:`zerolearn.memory` (Sec 3, 5, 7; Fig 1; Table 1), from measured training reports
(``--memory-timeline``), or from the allocator simulator of
:mod:`zerolearn.residual.defrag` (Sec 6.3); nothing is re-derived here.

Units: bytes in data. Figures of formulas use the paper's decimal GB (1e9 bytes);
figures of measured runs use binary KiB (2**10 bytes), as small models are measured.

Modules, re-exported here: :mod:`~zerolearn.figures.formulas` (the paper's formulas:
memory, fit, trade-off, each stage beside DP, ZeRO-R), :mod:`~zerolearn.figures.measured`
(a run's memory timeline, fragmentation) and :mod:`~zerolearn.figures.timeline` (per-rank
step timelines of compute and collectives, recorded by :mod:`zerolearn.timeline`) and
:mod:`~zerolearn.figures.bench` (step time and bytes against world size and model size,
recorded by ``make bench``). :mod:`~zerolearn.figures.schematics` draws each mechanism (who
holds which slice, the collectives, the ZeRO-1 step, buckets, ZeRO-3's schedule, Megatron,
offload, ZeRO++) from the package's own state, and :mod:`~zerolearn.figures.animate` turns a
schematic's steps into a play / step control and kernel-free HTML.
"""

from zerolearn.figures import schematics
from zerolearn.figures.animate import StepThrough, step_through
from zerolearn.figures.bench import load_result, scaling_figure, scaling_series
from zerolearn.figures.formulas import (
    CATEGORIES,
    COLORS,
    GPUS,
    NDS,
    PHASE_COLORS,
    STAGE_COLORS,
    fewest_gpus,
    fit_figure,
    memory_by_stage,
    memory_figure,
    readable,
    tradeoff,
    tradeoff_figure,
)
from zerolearn.figures.measured import (
    fragmentation,
    fragmentation_figure,
    recorded_trace,
    timeline_figure,
    timeline_series,
)
from zerolearn.figures.timeline import (
    OP_COLORS,
    bucket_sweep_figure,
    lanes_figure,
    prefetch_figure,
    stage_timelines_figure,
    sweep_timelines_figure,
)

__all__ = ["CATEGORIES", "COLORS", "GPUS", "NDS", "PHASE_COLORS", "STAGE_COLORS", "fewest_gpus", "fit_figure",
           "fragmentation", "fragmentation_figure", "memory_by_stage", "memory_figure", "readable",
           "recorded_trace", "timeline_figure", "timeline_series", "tradeoff", "tradeoff_figure",
           "OP_COLORS", "bucket_sweep_figure", "lanes_figure", "prefetch_figure", "stage_timelines_figure",
           "sweep_timelines_figure", "load_result", "scaling_figure", "scaling_series", "schematics", "StepThrough",
           "step_through"]
