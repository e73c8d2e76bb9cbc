"""How long a reader waits for the checker, printed (``python -m zerolearn.exercises latency``):
a skeleton is answered before any rank starts, a correct function on ranks started for it,
then on the ranks the first check kept. The figures are printed, not asserted; what is
asserted is that each answer is the right one and that the skeleton and the kept ranks start
no process."""

import pytest

from zerolearn import exercises
from zerolearn.exercises import EXERCISES, timing

pytestmark = pytest.mark.slow  # ranks started twice per exercise

NAMES = ["02.shard_range"]  # integer arithmetic: the wait is the ranks


def test_latency_table_answers_each_case_as_a_reader_meets_it(monkeypatch, capsys):
    started = []
    original = exercises.core._on_ranks

    def counting(exercise, fn, world_size):
        started.append((exercise.name, world_size, world_size in exercises.core._POOLS))
        return original(exercise, fn, world_size)

    monkeypatch.setattr(exercises.core, "_on_ranks", counting)
    rows = timing.latency(NAMES)
    table = capsys.readouterr().out
    print(table)  # the figures, for the log
    assert [(name, case) for name, case, *_ in rows] == [(n, c) for n in NAMES for c in timing.LATENCY_CASES]
    assert all(ok for *_, ok in rows), rows
    for name in NAMES:
        sizes = EXERCISES[name].world_sizes
        # the skeleton reached no rank; the first correct check found none kept, the second found them all
        assert [(s, kept) for n, s, kept in started if n == name] == [(s, False) for s in sizes] + \
            [(s, True) for s in sizes]
    assert exercises.core._POOLS == {}  # latency() ends the ranks it started
    assert len(table.splitlines()) == 1 + len(rows)
