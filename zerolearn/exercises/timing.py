"""How long the checker takes to a verdict when a mistake lives on one rank only.

For every rank exercise, three functions that are right on all ranks but one:

* its first known bug on rank 0 only (the reference solution elsewhere);
* the same bug on the last rank only;
* a function that raises on the last rank only.

Each is checked on persistent ranks (:func:`zerolearn.exercises.reusing_ranks`) and timed
from the call of :func:`zerolearn.exercises.check` to its verdict; the table is what
``python -m zerolearn.exercises times`` prints. A rank that stops early leaves its peers
waiting in a collective; the checker must still answer within seconds, with the rank's
own words.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from zerolearn import dist as zdist
from zerolearn.exercises.core import EXERCISES, check, reusing_ranks


class RaisedOnOneRank(RuntimeError):
    """What :class:`OnOneRank` raises on its rank when given no function for it."""


@dataclass
class OnOneRank:
    """A function that runs ``there`` on rank ``rank`` (``-1``: the last rank) and ``elsewhere``
    on the other ranks; with ``there`` None it raises :class:`RaisedOnOneRank` on that rank."""

    elsewhere: Callable
    there: Callable | None
    rank: int

    def __call__(self, *args, **kwargs):
        ctx = zdist.context()
        if ctx.rank != self.rank % ctx.world_size:
            return self.elsewhere(*args, **kwargs)
        if self.there is None:
            raise RaisedOnOneRank(f"a mistake on rank {ctx.rank} of {ctx.world_size} only")
        return self.there(*args, **kwargs)


CASES = ("bug on rank 0", "bug on last rank", "raises on last rank")


def cases(name: str) -> dict[str, OnOneRank]:
    """The three one-rank functions of exercise ``name`` (a rank exercise with a known bug)."""
    exercise = EXERCISES[name]
    bug = next(iter(exercise.bugs.values())).fn
    return {CASES[0]: OnOneRank(exercise.solution, bug, 0), CASES[1]: OnOneRank(exercise.solution, bug, -1),
            CASES[2]: OnOneRank(exercise.solution, None, -1)}


def time_to_verdict(names: list[str] | None = None, out=print) -> list[tuple[str, str, float, str]]:
    """Check every case of every rank exercise in ``names`` (default: all) and ``out`` a table
    of seconds to the verdict, with the verdict; returns (exercise, case, seconds, verdict) rows."""
    names = [n for n in (names or sorted(EXERCISES)) if EXERCISES[n].world_sizes and EXERCISES[n].bugs]
    rows = []
    with reusing_ranks():
        for name in names:
            check(name, solution=True, quiet=True)  # the pools start here, not in the first timed case
            for case, fn in cases(name).items():
                t0 = time.perf_counter()
                result = check(name, fn, quiet=True)
                rows.append((name, case, time.perf_counter() - t0, str(result)))
    out(f"{'exercise':25} {'case':20} {'seconds':>7}  verdict")
    for name, case, seconds, verdict in rows:
        said = verdict.split(": ", 1)[-1] if verdict.startswith(name) else verdict
        out(f"{name:25} {case:20} {seconds:7.1f}  {said}")
    return rows
