"""The reader writes torch.distributed itself: every reference solution of chapters 01-05 and 08
(the chapters whose exercises communicate) calls collectives by torch's names only and passes its
check; the same solution written with zerolearn.comm's wrappers passes too; no lesson or exercise
cell of those chapters calls the wrappers; and the checker never tells the reader to use them."""

import inspect
import re
from pathlib import Path

import pytest

from zerolearn import comm, exercises
from zerolearn.exercises import EXERCISES, check

pytestmark = pytest.mark.slow  # exercises under torch's names on ranks

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ("01", "02", "03", "04", "05", "08")
NAMES = sorted(n for n in EXERCISES if n[:2] in CHAPTERS)
COLLECTIVE = re.compile(r"\b(?:dist|torch\.distributed)\.(all_reduce|reduce_scatter_single|all_gather_single|"
                        r"broadcast)\(")
WRAPPER = re.compile(r"\bcomm\.(all_reduce|reduce_scatter|all_gather|broadcast)\(")
TO_COMM = {"dist.all_reduce(": "comm.all_reduce(", "dist.reduce_scatter_single(": "comm.reduce_scatter(",
           "dist.all_gather_single(": "comm.all_gather(", "dist.broadcast(": "comm.broadcast("}
MOVING = [n for n in NAMES if COLLECTIVE.search(exercises.solution_source(n))]


@pytest.fixture(scope="module", autouse=True)
def persistent_ranks():
    with exercises.reusing_ranks():
        yield


def as_comm(name: str):
    """The reference solution with every torch collective replaced by comm's wrapper, as a cell defines it."""
    source = exercises.solution_source(name)
    for torch_name, wrapper in TO_COMM.items():
        source = source.replace(torch_name, wrapper)
    namespace = {"__name__": "__main__", "comm": comm}
    exec(compile(exercises.PRELUDE + "\n" + source, "<cell>", "exec"), namespace)  # noqa: S102
    return namespace[EXERCISES[name].solution.__name__]


def test_solutions_call_torch_names_only():
    assert len(MOVING) >= 10, MOVING
    for name in NAMES:
        source = exercises.solution_source(name)
        assert not WRAPPER.search(source), f"{name}'s solution calls comm's wrapper"
        assert "comm" not in inspect.getsource(EXERCISES[name].solution).split('"""')[1], name  # the docstring


def test_no_lesson_or_exercise_cell_calls_comms_wrappers():
    sources = [src for chapter in CHAPTERS for src in sorted((ROOT / "notebooks" / "src").glob(f"{chapter}_*.py"))]
    assert len(sources) == len(CHAPTERS), sources
    for src in sources:
        code = "\n".join(line for line in src.read_text().splitlines() if not line.startswith("#"))
        code = re.sub(r'"[^"\n]*"|\'[^\'\n]*\'', '""', code)  # strings: the excerpts' anchors
        assert not WRAPPER.search(code), f"{src.name}: {WRAPPER.search(code).group(0)}"


@pytest.mark.parametrize("name", MOVING)
def test_a_solution_written_with_comms_wrappers_passes_too(name):
    result = check(name, as_comm(name), quiet=True)
    assert result.passed, str(result)


def test_the_checker_never_asks_for_comm():
    chapters = ROOT / "zerolearn" / "chapters"
    paths = [path for chapter in CHAPTERS for path in sorted(chapters.glob(f"ch{chapter}/*_check.py"))]
    assert len(paths) >= 2 * len(CHAPTERS), paths
    for path in paths:
        for message in re.findall(r'Wrong\((f?"[^)]*)', path.read_text()):
            words = re.sub(r"\{[^}]*(\}|$)", "", message)  # what the reader reads, not the values filled in
            assert "comm." not in words, f"{path.name}: {message[:80]}"
