"""How long the checker takes: to a verdict when a mistake lives on one rank only
(:func:`time_to_verdict`), and to any answer as a reader meets it (:func:`latency`).

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
from zerolearn.exercises.core import EXERCISES, check, close_ranks, reusing_ranks, skeleton


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


def _skeleton_function(name: str) -> Callable:
    """The reader's copy's function for ``name``, defined as a notebook cell defines it (its
    source readable, so the checker sees it is a skeleton)."""
    import linecache
    import uuid

    from zerolearn.exercises.core import PRELUDE

    text = PRELUDE + "\n" + skeleton(name)
    filename = f"<cell {uuid.uuid4().hex}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - the package's own skeleton
    return namespace[EXERCISES[name].solution.__name__]


LATENCY_CASES = ("not written yet", "correct, first check", "correct, ranks kept")


def latency(names: list[str] | None = None, out=print) -> list[tuple[str, str, float, bool]]:
    """Seconds from :func:`zerolearn.exercises.check` to its answer for every rank exercise in
    ``names`` (default: all), as a reader meets them: the reader's copy's skeleton, the
    reference solution on ranks started for it (none kept from before: the first check of a
    notebook), and the same on the ranks the first one kept. ``out`` gets a table; returns
    (exercise, case, seconds, answered as expected) rows."""
    names = [n for n in (names or sorted(EXERCISES)) if EXERCISES[n].world_sizes]
    rows = []
    for name in names:
        close_ranks()
        for case in LATENCY_CASES:
            fn = _skeleton_function(name) if case == LATENCY_CASES[0] else EXERCISES[name].solution
            t0 = time.perf_counter()
            result = check(name, fn, quiet=True)
            seconds = time.perf_counter() - t0
            rows.append((name, case, seconds, result.passed if result.written else case == LATENCY_CASES[0]))
    close_ranks()
    out(f"{'exercise':25} {'case':22} {'seconds':>7}  as expected")
    for name, case, seconds, ok in rows:
        out(f"{name:25} {case:22} {seconds:7.2f}  {'yes' if ok else 'NO'}")
    return rows
