"""Build-it exercises, one checker: ``check("02.zero1_step", zero1_step)``.

The reader writes the core of each chapter's mechanism as a function with a stated
signature; :func:`check` runs it on 2 and 3 real ranks against single-process
training and the communication and memory ledgers and names the first wrong thing.
``python -m zerolearn.exercises list`` names every exercise; ``check NAME|--all
[--solution | --bug NAME]`` runs them. See :mod:`zerolearn.exercises.core`.

Each exercise lives with its chapter, in :mod:`zerolearn.chapters`: the reader's
function ``chNN/<name>.py`` beside its check ``chNN/<name>_check.py``, which registers
it when imported here.
"""

from zerolearn.chapters.ch00 import max_batch_check, model_state_bytes_check  # noqa: F401 - they register
from zerolearn.chapters.ch01 import (  # noqa: F401
    allreduce_check,
    average_gradients_check,
    broadcast_model_check,
    bucket_hook_check,
)
from zerolearn.chapters.ch02 import flatten_params_check, shard_range_check, zero1_step_check  # noqa: F401
from zerolearn.chapters.ch03 import accumulate_check, reduce_scatter_hook_check  # noqa: F401
from zerolearn.chapters.ch04 import gather_hooks_check, main_check, nano_engine_check, prefetch_check  # noqa: F401
from zerolearn.chapters.ch05 import constant_buffer_check, partition_checkpoint_check, tensor_parallel_check  # noqa: F401
from zerolearn.chapters.ch06 import fewest_gpus_check, max_psi_check  # noqa: F401
from zerolearn.chapters.ch07 import choose_stage_check, stage_from_bytes_check  # noqa: F401
from zerolearn.chapters.ch08 import dpu_step_check, quantized_all_gather_check  # noqa: F401
from zerolearn.exercises.core import (
    EXERCISES,
    PRELUDE,
    Bug,
    Exercise,
    Mistake,
    Result,
    Wrong,
    check,
    close_ranks,
    first_difference,
    get,
    reusing_ranks,
    skeleton,
    solution_source,
)
from zerolearn.exercises.program import PROGRAMS

__all__ = ["EXERCISES", "PRELUDE", "PROGRAMS", "Bug", "Exercise", "Mistake", "Result", "Wrong", "check", "close_ranks",
           "first_difference", "get", "reusing_ranks", "show", "skeleton", "solution_source"]


def show(name: str) -> None:
    """Print the reference solution of exercise ``name`` (the reader's copy points here)."""
    print(solution_source(name))
