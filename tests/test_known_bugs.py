"""Known bugs written as edits of their reference solution (zerolearn.exercises.core.edited):
each differs from its solution only in the lines its edits state, an edit that no longer
matches fails when the bug is built (naming the bug), and the built function is the
solution's in every other respect: signature, line numbers, source, pickled by reference."""

import inspect
import pickle
import sys
import traceback

import cloudpickle
import pytest

from zerolearn.chapters.ch02.shard_range import shard_range
from zerolearn.exercises import EXERCISES, Bug, Exercise, core
from zerolearn.exercises.core import edited

pytestmark = pytest.mark.quick

EDITED = sorted(((n, b, bug.fn) for n in EXERCISES for b, bug in EXERCISES[n].bugs.items()
                 if hasattr(bug.fn, "edited_from")), key=lambda t: t[:2])


def _lines_of(source: str, texts) -> set[int]:
    """0-based indices of the lines of ``source`` that an occurrence of one of ``texts`` covers."""
    covered = set()
    for text in texts:
        start = source.find(text)
        while text and start >= 0:
            covered.update(range(source.count("\n", 0, start), source.count("\n", 0, start + len(text) - 1) + 1))
            start = source.find(text, start + 1)
    return covered


def _applied(source: str, edits: dict[str, str]) -> tuple[str, set[int]]:
    """``source`` with the edits applied in turn (each old text found exactly once), and the
    0-based indices of its lines that the new texts make or change (a deletion of whole lines
    leaves none; a deletion inside a line changes that line)."""
    for old, new in edits.items():
        assert source.count(old) == 1, old
        at = source.index(old)
        whole_lines = not new and old.endswith("\n") and (at == 0 or source[at - 1] == "\n")
        source = source.replace(old, "" if whole_lines else f"\x00{new}\x01")
    touched, line, inside, empty = set(), 0, False, False
    for ch in source:
        if ch == "\x00":
            inside, empty = True, True
        elif ch == "\x01":
            inside = False
            if empty:
                touched.add(line)
        else:
            if inside:
                touched.add(line)
                empty = False
            line += ch == "\n"
    return source.replace("\x00", "").replace("\x01", ""), touched


def test_most_known_bugs_are_edits_of_their_solution():
    assert len(EDITED) >= 70, len(EDITED)


@pytest.mark.parametrize("name, bug, fn", EDITED, ids=[f"{n}-{b}" for n, b, _ in EDITED])
def test_an_edited_bug_differs_from_its_solution_only_where_its_edits_say(name, bug, fn):
    solution = EXERCISES[name].solution
    assert fn.edited_from is solution
    want, got = inspect.getsource(solution), inspect.getsource(fn)
    want_lines, got_lines = want.splitlines(), got.splitlines()
    assert got_lines[0] == want_lines[0].replace(f"def {solution.__name__}(", f"def {fn.__name__}(", 1)
    edited_source, added = _applied(want, fn.edits)
    renamed = edited_source.replace(f"def {solution.__name__}(", f"def {fn.__name__}(", 1)
    assert got == renamed, f"{name} --bug {bug}: the source is not the solution's with its edits"
    removed = _lines_of(want, fn.edits)
    kept_want = [line for i, line in enumerate(want_lines) if i not in removed]
    kept_got = [line for i, line in enumerate(got_lines) if i not in added]
    assert kept_want[1:] == kept_got[1:], f"{name} --bug {bug}: lines beyond its edits differ"
    assert inspect.signature(fn) == inspect.signature(solution)
    assert fn.__module__ == EXERCISES[name].trial.__module__  # its check module
    assert getattr(sys.modules[fn.__module__], fn.__qualname__) is fn  # sent to the ranks by reference
    assert pickle.loads(cloudpickle.dumps(fn)) is fn


def test_an_edit_that_does_not_match_raises_when_the_bug_is_built_naming_it():
    with pytest.raises(ValueError, match=r"known bug .*\._stale_bug: the text 'padding = psi % world_size' occurs 0 "
                                         r"times in the source of zerolearn\.chapters\.ch02\.shard_range\.shard_range"):
        edited(shard_range, {"padding = psi % world_size": "padding = 0"}, name="_stale_bug")
    with pytest.raises(ValueError, match=r"_twice_bug: the text 'rank' occurs \d+ times"):
        edited(shard_range, {"rank": "rank + 1"}, name="_twice_bug")
    with pytest.raises(ValueError, match="_empty_bug: an empty text"):
        edited(shard_range, {"": "x"}, name="_empty_bug")
    with pytest.raises(ValueError, match="_broken_bug: the edited source of shard_range does not compile"):
        edited(shard_range, {"padding = -psi % world_size": "padding = ("}, name="_broken_bug")


_raises_at_its_edit = edited(shard_range, {"padding = -psi % world_size": "padding = psi // 0"},
                             name="_raises_at_its_edit", doc="Divides by zero where the padding is computed.")


def test_an_edited_bug_is_named_at_its_edited_line_in_the_solutions_numbering():
    fn = _raises_at_its_edit
    assert fn.__name__ == "_raises_at_its_edit" and fn.__doc__ == "Divides by zero where the padding is computed."
    lines, first = inspect.getsourcelines(shard_range)
    line = first + next(i for i, text in enumerate(lines) if "padding = -psi % world_size" in text)
    with pytest.raises(ZeroDivisionError) as raised:
        fn(22, 2, 1)
    where = core._reader_frames(traceback.extract_tb(raised.value.__traceback__))
    assert where == f" (line {line}: padding = psi // 0)"
    assert core.defined_at(fn) == f" (line {first}: def _raises_at_its_edit(psi, world_size, rank):)"
    assert shard_range(22, 2, 1) == (11, 22, 0)  # the solution itself is untouched


def test_register_refuses_an_edited_bug_its_module_does_not_bind():
    unbound = edited(shard_range, {"padding = -psi % world_size": "padding = 0"}, name="_not_bound_here")
    exercise = Exercise("99.unbound_bug", "t", shard_range, lambda fn: "", {"b": Bug(unbound, "s", "w")})
    try:
        with pytest.raises(ValueError, match="bind it in .* as _not_bound_here = edited"):
            core.register(exercise)
    finally:
        EXERCISES.pop("99.unbound_bug", None)
