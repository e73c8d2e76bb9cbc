"""Show, don't print: chapters 00-05 teach with the reader's own code and short excerpts,
not with printed package source. Measured on the stored notebooks: printed Python source of
the package is at most 10% of the stream-output lines of a chapter, and no block of package
source in any output (printed, or an excerpt shown as a code block) is longer than 15 lines.

A line of output is package source when, stripped, it is one of the package's source lines
(stripped) of at least 8 characters; a block is a run of such lines, with the shorter lines
and blank lines between them (``)``, ``else:``) counted in the run.
"""

import json
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p for p in (ROOT / "notebooks").glob("0[0-5]_*.ipynb"))
MIN_CHARS = 8
MAX_SHARE, MAX_BLOCK = 0.10, 15


@cache
def package_lines() -> frozenset[str]:
    lines = set()
    for path in (ROOT / "zerolearn").rglob("*.py"):
        lines |= {s for s in (line.strip() for line in path.read_text().splitlines()) if len(s) >= MIN_CHARS}
    return frozenset(lines)


def source_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each run of package-source lines in ``lines``, end exclusive."""
    known = package_lines()
    hits = [i for i, line in enumerate(lines) if line.strip() in known]
    blocks: list[tuple[int, int]] = []
    for i in hits:
        between = lines[blocks[-1][1]:i] if blocks else []
        if blocks and all(len(s.strip()) < MIN_CHARS or s.strip() in known for s in between):
            blocks[-1] = (blocks[-1][0], i + 1)
        else:
            blocks.append((i, i + 1))
    return blocks


def output_texts(nb: dict):
    """(kind, text) of every output: "stream", or the text/plain and text/markdown of a result."""
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                yield "stream", "".join(out["text"])
            for mime in ("text/plain", "text/markdown"):
                if mime in out.get("data", {}):
                    yield mime, "".join(out["data"][mime])


def measure(path: Path) -> dict:
    """Stream-output lines, package-source lines among them, and the longest source block anywhere."""
    nb = json.loads(path.read_text())
    stream = source = longest = 0
    for kind, text in output_texts(nb):
        lines = text.splitlines()
        blocks = source_blocks(lines)
        longest = max([longest] + [end - start for start, end in blocks])
        if kind == "stream":
            stream += len(lines)
            source += sum(end - start for start, end in blocks)
    return {"stream": stream, "source": source, "longest": longest}


def test_the_measure_finds_printed_source():
    import inspect

    from zerolearn.nano import NanoZero

    printed = inspect.getsource(NanoZero.step).splitlines()
    lines = ["loss 5.5486", *printed, "done"]
    assert source_blocks(lines) == [(1, 1 + len(printed))]
    assert source_blocks(["stage 0 on 2 ranks", "| 1 | 2 |"]) == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_shows_rather_than_prints(path):
    m = measure(path)
    share = m["source"] / max(m["stream"], 1)
    print(f"{path.stem}: {m['stream']} stream-output lines, {m['source']} of them package source "
          f"({share:.0%}); longest source block {m['longest']} lines")
    assert share <= MAX_SHARE, f"{path.stem}: {m['source']} of {m['stream']} printed lines are package source"
    assert m["longest"] <= MAX_BLOCK, f"{path.stem}: a block of {m['longest']} lines of package source"
