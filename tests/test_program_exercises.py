"""Program exercises: the reader writes a whole script (chapter 1's ``allreduce.py``) and the
checker runs it under torchrun on 2 and 3 ranks, naming each known mistake by rank with its cause;
the reader's copy holds the script's skeleton and leaves the torchrun line to the reader."""

import sys
import time
from pathlib import Path

import pytest

from zerolearn import exercises
from zerolearn.errors import ConfigError
from zerolearn.exercises import program

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import build  # noqa: E402 - notebooks/build.py

pytestmark = pytest.mark.quick

NAME = "01.allreduce"
PROGRAM = program.PROGRAMS[NAME]


def test_the_program_is_listed_and_shown_beside_the_functions(capsys):
    assert exercises.get(NAME) is PROGRAM
    exercises.show(NAME)
    shown = capsys.readouterr().out
    assert shown.startswith("%%writefile allreduce.py\n")
    assert "dist.init_process_group(" in shown and "dist.destroy_process_group()" in shown
    assert "BEGIN SOLUTION" not in shown


def test_the_skeleton_is_not_written_yet_at_once_without_a_launch(tmp_path, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a skeleton started torchrun")

    monkeypatch.setattr(program, "launch", no_launch)
    skeleton = exercises.skeleton(NAME)
    assert skeleton.startswith("%%writefile allreduce.py\n") and "raise NotImplementedError" in skeleton
    script = tmp_path / "allreduce.py"
    script.write_text(skeleton.split("\n", 1)[1])  # what %%writefile writes
    start = time.perf_counter()
    result = exercises.check(NAME, str(script), quiet=True)
    assert time.perf_counter() - start < 1.0
    assert not result.written and not result.passed
    assert program.unwritten(script.read_text()) and not program.unwritten(PROGRAM.text())


def test_a_missing_file_or_a_function_is_refused_naming_what_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no such file .*run the %%writefile allreduce.py cell first"):
        exercises.check(NAME, "allreduce.py")
    with pytest.raises(ConfigError, match="pass its file name"):
        exercises.check(NAME, print)
    with pytest.raises(ConfigError, match="allowed are no_init"):
        exercises.check(NAME, bug="no_such_bug")


def test_a_syntax_error_is_named_with_its_line_before_any_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(program, "launch", lambda *a, **k: pytest.fail("launched a script that does not compile"))
    script = tmp_path / "allreduce.py"
    script.write_text("import os\n\ndef main(:\n    pass\n")
    result = exercises.check(NAME, str(script), quiet=True)
    assert not result.passed and "line 3: SyntaxError" in str(result)


def test_the_readers_copy_has_the_skeleton_and_leaves_the_torchrun_line_to_the_reader():
    book = build.read_source(build.SRC / "01_data_parallelism.py")
    copy = build.read_source(build.SRC / "01_data_parallelism.py", reader=True)
    typed = [i for i, c in enumerate(book.cells) if "reader-types" in c.metadata.get("tags", [])]
    assert len(typed) == 1
    assert "torch.distributed.run --standalone --nproc-per-node 2 allreduce.py" in book.cells[typed[0]].source
    assert "torch.distributed.run" not in copy.cells[typed[0]].source
    assert build.TYPE_HERE in copy.cells[typed[0]].source
    exercise = [c.source for c in copy.cells if c.source.startswith("%%writefile allreduce.py")]
    assert len(exercise) == 1 and "raise NotImplementedError" in exercise[0]


@pytest.mark.slow
def test_the_solution_passes_under_torchrun_on_2_and_3_ranks():
    result = exercises.check(NAME, solution=True, quiet=True)
    assert result.passed, str(result)
    assert "on 2 and 3 ranks" in str(result)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PROGRAM.bugs))
def test_each_known_bug_is_named_with_its_cause(bug):
    result = exercises.check(NAME, bug=bug, quiet=True)
    assert result.written and not result.passed, bug
    assert PROGRAM.bugs[bug].says in str(result), str(result)
    assert result.mistake.rank is not None, str(result)  # named by rank
    if bug == "two_ranks_only":  # right on 2 ranks: only the 3-rank launch shows it
        assert result.world_size == 3, str(result)
