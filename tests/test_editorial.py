"""The chapters read as a textbook: measured on the stored notebooks, every chapter keeps
its cells short, its tables narrow, its solutions folded and no test machinery in view,
and ends with questions the reader answers by predicting a number and then running a cell.

Limits: a code cell outside the exercises at most 15 non-blank lines; a markdown cell at
most 200 words; a printed table (``zerolearn.tables.text_table``'s rule of dashes) at
most 7 columns; no ``NBVAL`` comment in any cell; every exercise solution folded
(``metadata.jupyter.source_hidden``); a "Questions" section of 3 or 4 numbered
questions ("1. " or "**1.** "), each markdown cell of them followed by a code cell.
"""

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
APPENDICES = {"06a_memory_explorer"}  # a page holding one widget, not a chapter
RULE = re.compile(r"^\s*-+(\s+-+)+\s*$")  # text_table's rule under the header: one dash group per column

MAX_CODE_LINES, MAX_WORDS, MAX_COLUMNS = 15, 200, 7


def measure(path: Path) -> dict:
    """What the limits are held against, for one stored notebook: the longest code cell
    outside exercises (non-blank lines), the longest markdown cell (words), the widest
    printed table (columns), visible NBVAL markers, exercise cells not folded, and the
    questions (number, and whether each is followed by a code cell)."""
    cells = json.loads(path.read_text())["cells"]
    out = {"code": (0, None), "words": (0, None), "columns": (0, None), "markers": [], "unfolded": [],
           "questions": 0, "answered": True}
    in_questions = False
    for i, cell in enumerate(cells):
        source, tags = "".join(cell["source"]), cell["metadata"].get("tags", [])
        if "NBVAL" in source:
            out["markers"].append(i)
        if cell["cell_type"] == "markdown":
            if re.match(r"#+ ", source):
                in_questions = bool(re.match(r"#+ (\d+\. )?Questions\b", source))
            out["words"] = max(out["words"], (len(source.split()), i))
            if in_questions:
                asked = len(re.findall(r"^(\d+\.|\*\*\d+\.\*\*) ", source, re.M))
                out["questions"] += asked
                follows = cells[i + 1]["cell_type"] if i + 1 < len(cells) else None
                out["answered"] &= not asked or follows == "code"
            continue
        if "exercise" in tags:
            if cell["metadata"].get("jupyter", {}).get("source_hidden") is not True:
                out["unfolded"].append(i)
            continue
        out["code"] = max(out["code"], (len([line for line in source.splitlines() if line.strip()]), i))
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            for line in ("".join(text) if isinstance(text, list) else text).splitlines():
                if RULE.match(line):
                    out["columns"] = max(out["columns"], (len(line.split()), i))
    return out


MEASURED = {path.stem: measure(path) for path in CHAPTERS}


@pytest.mark.parametrize("name", MEASURED)
def test_cells_are_short_and_tables_narrow(name):
    m = MEASURED[name]
    assert m["code"][0] <= MAX_CODE_LINES, f"{name}: code cell {m['code'][1]} has {m['code'][0]} lines"
    assert m["words"][0] <= MAX_WORDS, f"{name}: markdown cell {m['words'][1]} has {m['words'][0]} words"
    assert m["columns"][0] <= MAX_COLUMNS, f"{name}: cell {m['columns'][1]} prints {m['columns'][0]} columns"


@pytest.mark.parametrize("name", MEASURED)
def test_no_test_machinery_in_view_and_solutions_folded(name):
    assert MEASURED[name]["markers"] == [] and MEASURED[name]["unfolded"] == [], MEASURED[name]


@pytest.mark.parametrize("name", [n for n in MEASURED if n not in APPENDICES])
def test_every_chapter_ends_with_questions_answered_by_a_cell(name):
    m = MEASURED[name]
    assert 3 <= m["questions"] <= 4, f"{name}: {m['questions']} questions"
    assert m["answered"], f"{name}: a question without a cell to run after it"


def test_the_measure_sees_a_long_cell_a_wide_table_and_a_marker(tmp_path):
    wide = "  ".join(["--"] * 9)
    nb = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": ["## Questions\n", "\n", "1. How many?\n"]},
        {"cell_type": "code", "metadata": {}, "source": ["# NBVAL_IGNORE_OUTPUT\n"] + ["x = 1\n"] * 16,
         "outputs": [{"output_type": "stream", "text": [" a  b\n", wide + "\n"]}]},
        {"cell_type": "code", "metadata": {"tags": ["exercise"]}, "source": ["def f():\n"] * 40, "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source": ["**2.** And then?"]},
    ]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    m = measure(path)
    assert m["code"] == (17, 1) and m["columns"] == (9, 1) and m["markers"] == [1] and m["unfolded"] == [2]
    assert m["questions"] == 2 and not m["answered"]  # the last question has no cell after it
