"""Every exercise's reference solution passes its check, every known bug is caught with
its message, and the checker's own verdicts (not written yet, a raising function, bad
names) read as the book says."""

import linecache
import subprocess
import sys
import uuid

import pytest

from zerolearn import exercises
from zerolearn.errors import ConfigError
from zerolearn.exercises import EXERCISES, check

pytestmark = pytest.mark.slow  # every exercise and known bug on fresh and pooled ranks

NAMES = sorted(EXERCISES)
BUGS = [(n, b) for n in NAMES for b in EXERCISES[n].bugs]
RANK_EXERCISES = [n for n in NAMES if EXERCISES[n].world_sizes]


@pytest.fixture(scope="module", autouse=True)
def persistent_ranks():
    """One pool of ranks per world size for the whole module, as ``check --all`` uses;
    tests that need fresh ranks leave it with ``fresh_ranks``."""
    with exercises.reusing_ranks():
        yield


def _defined_in_a_cell(name: str, source: str):
    """The function ``source`` defines, compiled as a notebook cell is (not importable by name; its
    source kept in linecache under the cell's own file name, as IPython keeps it)."""
    namespace = {"__name__": "__main__"}
    text = exercises.PRELUDE + "\n" + source
    filename = f"<cell {uuid.uuid4().hex}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(compile(text, filename, "exec"), namespace)
    return namespace[EXERCISES[name].solution.__name__]


def test_chapters_01_to_05_and_08_have_at_least_two_exercises_each():
    for chapter in ("01", "02", "03", "04", "05", "08"):
        assert sum(e.chapter == chapter for e in EXERCISES.values()) >= 2, chapter


@pytest.mark.parametrize("name", NAMES)
def test_reference_solution_passes(name):
    result = check(name, solution=True, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("name,bug", BUGS, ids=[f"{n}-{b}" for n, b in BUGS])
def test_known_bug_is_caught_with_its_message(name, bug):
    result = check(name, bug=bug, quiet=True)
    assert result.written and not result.passed, f"{name} --bug {bug} passed the check"
    assert EXERCISES[name].bugs[bug].says in str(result), str(result)


@pytest.mark.parametrize("name", NAMES)
def test_skeleton_keeps_the_signature_and_docstring_and_raises(name, monkeypatch):
    def no_ranks(*args, **kwargs):
        raise AssertionError("a skeleton started ranks")

    monkeypatch.setattr(exercises.core, "_on_ranks", no_ranks)  # said at once: nothing to run
    monkeypatch.setattr(exercises.core, "run_trial", no_ranks)
    skeleton = exercises.skeleton(name)
    solution = exercises.solution_source(name)
    assert skeleton.splitlines()[0] == solution.splitlines()[0]  # the def line
    assert "raise NotImplementedError" in skeleton and "raise NotImplementedError" not in solution
    assert EXERCISES[name].solution.__doc__, f"{name}: the reader needs the docstring"
    result = check(name, _defined_in_a_cell(name, skeleton), quiet=True)
    assert not result.written and "not written yet" in str(result)


def test_a_function_that_raises_not_implemented_after_some_work_is_not_written_yet_on_the_ranks():
    skeleton = exercises.skeleton("02.zero1_step").replace(
        "raise NotImplementedError", "n = flat_params.numel() // world_size\n    raise NotImplementedError")
    assert "n = flat_params.numel()" in skeleton
    assert not exercises.core._only_raises_not_implemented(_defined_in_a_cell("02.zero1_step", skeleton))
    result = check("02.zero1_step", _defined_in_a_cell("02.zero1_step", skeleton), quiet=True)
    assert not result.written and "not written yet" in str(result)


@pytest.mark.parametrize("name", NAMES)
def test_the_books_solution_cell_passes_with_only_the_prelude(name):
    # The book's cell holds solution_source(name), run after the chapter's prelude imports.
    result = check(name, _defined_in_a_cell(name, exercises.solution_source(name)), quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("name", RANK_EXERCISES[:1] + [pytest.param(n, marks=pytest.mark.slow)  # more ranks
                                                        for n in RANK_EXERCISES[-1:]])
def test_a_solution_written_in_a_cell_passes_on_fresh_ranks(name, monkeypatch):
    # What a reader's notebook does: the function travels by value to newly spawned ranks.
    monkeypatch.setattr(exercises.core, "_POOLS", {})
    try:
        result = check(name, _defined_in_a_cell(name, exercises.solution_source(name)), quiet=True)
        assert result.passed, str(result)
    finally:
        exercises.close_ranks()


def test_checks_outside_a_block_keep_their_ranks_for_the_next_check(monkeypatch):
    """A notebook's second check runs on the ranks its first one started (no new process), and
    close_ranks ends them."""
    kept = {}
    monkeypatch.setattr(exercises.core, "_POOLS", kept)
    name = RANK_EXERCISES[0]
    try:
        assert check(name, solution=True, quiet=True).passed
        pools = dict(kept)
        pids = {size: [p.pid for p in pool._procs] for size, pool in pools.items()}
        assert sorted(pools) == sorted(EXERCISES[name].world_sizes), pools
        assert check(name, solution=True, quiet=True).passed
        assert all(kept[size] is pools[size] for size in pools) and len(kept) == len(pools)
        assert {size: [p.pid for p in pool._procs] for size, pool in kept.items()} == pids
    finally:
        exercises.close_ranks()
    assert kept == {} and not any(pool.running for pool in pools.values())


def test_a_function_that_raises_is_named_with_its_line():
    name = NAMES[0]

    def broken(*args, **kwargs):
        return 1 / 0

    result = check(name, broken, quiet=True)
    assert not result.passed and "ZeroDivisionError" in str(result) and "1 / 0" in str(result)


def test_bad_names_are_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="allowed are"):
        check("02.no_such_exercise", solution=True)
    with pytest.raises(ConfigError, match="allowed are"):
        check(NAMES[0], bug="no_such_bug")
    with pytest.raises(ConfigError, match="exactly one"):
        check(NAMES[0])


def test_cli_lists_every_exercise_chapter_first():
    out = subprocess.run([sys.executable, "-m", "zerolearn.exercises", "list"], capture_output=True, text=True,
                         check=True).stdout
    assert [line.split()[0] for line in out.splitlines()] == sorted([*NAMES, *exercises.PROGRAMS])
    assert "01.allreduce" in out  # a program exercise, listed beside the functions


def test_cli_refuses_bad_arguments_with_exit_2():
    run = subprocess.run([sys.executable, "-m", "zerolearn.exercises", "check", "--all", "--bug", "x"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "use --bugs" in run.stderr


def test_a_notebook_cell_ending_in_check_shows_the_verdict_once(capsys):
    name = next(n for n in NAMES if not EXERCISES[n].world_sizes)
    result = check(name, solution=True)
    result._ipython_display_()  # what Jupyter calls for the cell's value
    assert capsys.readouterr().out.count(f"{name}: correct.") == 1
    quiet = check(name, solution=True, quiet=True)
    quiet._ipython_display_()
    assert capsys.readouterr().out.count(f"{name}: correct.") == 1
