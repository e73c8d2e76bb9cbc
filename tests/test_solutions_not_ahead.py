"""Solutions are never ahead of the reader: in the reader's copies, the cells before an
exercise's check hold little of its reference solution.

Measured as token n-gram overlap: the share of the solution's n-grams (n = 6 tokens, its
body between the markers) found in the cells, code and text, that come before the
check in the reader's copy. A pasted solution or an excerpt of the package's code that
answers the exercise scores near 1; prose that names the calls to make scores low.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest

from zerolearn import exercises

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
READERS = ROOT / "notebooks" / "exercises"
N = 6
LIMIT = 0.25  # at most a quarter of the solution's 6-grams may appear before its check
TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[^\sA-Za-z0-9_]")


def body(name: str) -> str:
    """The reference solution's lines between its markers, comments dropped."""
    src = textwrap.dedent(inspect.getsource(exercises.get(name).solution))
    inside, out = False, []
    for line in src.splitlines():
        if line.strip() == "# BEGIN SOLUTION":
            inside = True
        elif line.strip() == "# END SOLUTION":
            inside = False
        elif inside:
            out.append(line.split("#", 1)[0])
    return "\n".join(out)


def grams(text: str) -> set[tuple[str, ...]]:
    tokens = TOKEN.findall(text)
    return {tuple(tokens[i:i + N]) for i in range(len(tokens) - N + 1)}


def before_check(name: str) -> list[str]:
    """The sources of the reader's copy's cells before the cell that checks ``name``."""
    chapter = next(READERS.glob(f"{name[:2]}_*.ipynb"))
    cells = json.loads(chapter.read_text())["cells"]
    out = []
    for cell in cells:
        src = "".join(cell["source"])
        if f'exercises.check("{name}"' in src:
            return out
        if f"# exercise: {name}" in src or "raise NotImplementedError" in src and f'"{name}"' in src:
            continue  # the exercise's own skeleton
        out.append(src)
    raise AssertionError(f"{chapter.name} has no cell that checks {name}")


def overlap(name: str) -> float:
    want = grams(body(name))
    seen: set = set()
    for src in before_check(name):
        seen |= grams(src) & want
    return len(seen) / max(1, len(want))


RANKED = sorted(n for n in exercises.EXERCISES if n[:2] in ("01", "02", "03", "04"))


@pytest.mark.parametrize("name", RANKED)
def test_no_cell_before_the_check_holds_the_solution(name):
    share = overlap(name)
    assert share <= LIMIT, f"{name}: {share:.0%} of its solution's {N}-grams appear before its check"
