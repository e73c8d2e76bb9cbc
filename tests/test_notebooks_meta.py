"""Every chapter notebook is stored executed, in order, with outputs (nbval compares them)."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_was_executed_in_order_with_outputs(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells if "".join(c["source"]).strip()]
    assert counts == list(range(1, len(counts) + 1)), "run top to bottom in a fresh kernel, then save"
    assert any(c["outputs"] for c in cells)


def test_notebook_sources_are_kept_beside_the_notebooks():
    sources = {p.stem for p in (NOTEBOOKS[0].parent / "src").glob("[0-9]*.py")} if NOTEBOOKS else set()
    assert {p.stem for p in NOTEBOOKS} <= sources
