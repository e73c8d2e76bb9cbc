"""Schematics: pictures of each mechanism, drawn from the package's own state.

Every drawing is two functions: a pure data function (plain dataclasses, dicts and lists,
which the tests check) and a draw function returning a matplotlib ``Figure``. The data come
from the package, so a drawing cannot disagree with the code: shard ranges from
:class:`zerolearn.flat.FlatLayout`, bytes from :mod:`zerolearn.memory`, ZeRO-3's order from a
recorded :class:`zerolearn.engines.Zero3Engine` step, buckets from a stored timeline and the
cost model, the tensor-parallel blocks from :mod:`zerolearn.residual`, ZeRO++'s messages from
:mod:`zerolearn.zeropp`. Ranks have one colour each in every drawing
(:data:`~zerolearn.figures.schematics.palette.RANK_COLORS`). Drawings with steps also come as
step-through animations (:mod:`zerolearn.figures.animate`).

=========================  ===========================================  ==========================
module                     data                                         drawings
=========================  ===========================================  ==========================
``states``                 model_states, partitioned, offload_placement model_states_figure (Fig 1),
                                                                        offload_figure
``collectives``            collective, ring_all_reduce                  collectives_figure,
                                                                        ring_figure, ring_animation
``zero1_step``             zero1_frames                                 zero1_figure, zero1_animation
``buckets``                bucket_schedule                              bucket_schedule_figure
``zero3_units``            zero3_schedule                               zero3_figure, zero3_animation
``megatron``               tensor_split, checkpoint_chunks              megatron_figure
``zeropp_links``           zeropp_paths                                 zeropp_figure
=========================  ===========================================  ==========================
"""

from zerolearn.figures.schematics.buckets import BucketSchedule, bucket_schedule, bucket_schedule_figure
from zerolearn.figures.schematics.collectives import (
    COLLECTIVES,
    CollectiveState,
    RingStep,
    collective,
    collectives_figure,
    ring_all_reduce,
    ring_animation,
    ring_figure,
)
from zerolearn.figures.schematics.megatron import (
    CheckpointChunks,
    TensorSplit,
    checkpoint_chunks,
    megatron_figure,
    tensor_split,
)
from zerolearn.figures.schematics.palette import RANK_COLORS, rank_color
from zerolearn.figures.schematics.states import (
    ModelStates,
    Slice,
    model_states,
    model_states_figure,
    offload_figure,
    offload_placement,
    partitioned,
)
from zerolearn.figures.schematics.zero1_step import Zero1Frame, zero1_animation, zero1_figure, zero1_frames
from zerolearn.figures.schematics.zero3_units import (
    UnitEvent,
    Zero3Schedule,
    zero3_animation,
    zero3_figure,
    zero3_schedule,
)
from zerolearn.figures.schematics.zeropp_links import Message, zeropp_figure, zeropp_paths

__all__ = ["COLLECTIVES", "RANK_COLORS", "BucketSchedule", "CheckpointChunks", "CollectiveState", "Message",
           "ModelStates", "RingStep", "Slice", "TensorSplit", "UnitEvent", "Zero1Frame", "Zero3Schedule",
           "bucket_schedule", "bucket_schedule_figure", "checkpoint_chunks", "collective", "collectives_figure",
           "megatron_figure", "model_states", "model_states_figure", "offload_figure", "offload_placement",
           "partitioned", "rank_color", "ring_all_reduce", "ring_animation", "ring_figure", "tensor_split",
           "zero1_animation", "zero1_figure", "zero1_frames", "zero3_animation", "zero3_figure", "zero3_schedule",
           "zeropp_figure", "zeropp_paths"]
