"""Build-it exercises, one checker: ``check("02.zero1_step", zero1_step)``.

The reader writes the core of each chapter's mechanism as a function with a stated
signature; :func:`check` runs it on 2 and 3 real ranks against single-process
training and the communication and memory ledgers and names the first wrong thing.
``python -m zerolearn.exercises list`` names every exercise; ``check NAME|--all
[--solution | --bug NAME]`` runs them. See :mod:`zerolearn.exercises.core`.
"""

from zerolearn.exercises import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07  # noqa: F401 - they register
from zerolearn.exercises.core import (
    EXERCISES,
    PRELUDE,
    Bug,
    Exercise,
    Mistake,
    Result,
    Wrong,
    check,
    first_difference,
    get,
    reusing_ranks,
    skeleton,
    solution_source,
)

__all__ = ["EXERCISES", "PRELUDE", "Bug", "Exercise", "Mistake", "Result", "Wrong", "check", "first_difference",
           "get", "reusing_ranks", "show", "skeleton", "solution_source"]


def show(name: str) -> None:
    """Print the reference solution of exercise ``name`` (the reader's copy points here)."""
    print(solution_source(name))
