"""The stored chapter notebooks are what their sources say, executed top to bottom.

Each chapter's source is a jupytext percent script in ``notebooks/src/``; ``make
notebooks`` (``notebooks/build.py``) turns it into ``notebooks/<name>.ipynb`` and
executes it. nbval then compares the stored outputs with a fresh run. These tests catch
the two ways that can go stale: a source edited without rebuilding its notebook, and a
notebook saved out of order.
"""

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "notebooks"))
import build  # noqa: E402  (notebooks/build.py)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOURCES = build.sources()

pytestmark = [pytest.mark.quick, pytest.mark.notebook]


def _cells(nb) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_was_executed_in_order_with_outputs(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells if "".join(c["source"]).strip()]
    assert counts == list(range(1, len(counts) + 1)), f"rebuild it in a fresh kernel: make notebooks NB={path.stem}"
    assert any(c["outputs"] for c in cells)


def test_every_source_has_its_notebook_and_every_notebook_its_source():
    assert [p.stem for p in SOURCES] == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_stored_notebook_has_the_cells_of_its_source(src):
    stored = _cells(json.loads((ROOT / "notebooks" / f"{src.stem}.ipynb").read_text()))
    wanted = _cells(build.read_source(src))
    # Not strict: the first differing cell is named before the counts are compared below.
    for i, (have, want) in enumerate(zip(stored, wanted, strict=False)):
        assert have == want, (f"cell {i} of notebooks/{src.stem}.ipynb differs from notebooks/src/{src.name}; "
                              f"run: make notebooks NB={src.stem}\nstored:\n{have[1]}\nsource:\n{want[1]}")
    assert len(stored) == len(wanted), (f"notebooks/{src.stem}.ipynb has {len(stored)} cells, its source "
                                        f"{len(wanted)}; run: make notebooks NB={src.stem}")


def test_the_freshness_check_sees_an_edited_source(tmp_path):
    src = SOURCES[0]
    edited = tmp_path / src.name
    edited.write_text(src.read_text().replace("# %%\n", "# %%\nx = 1  # an edit\n", 1))
    stored = _cells(json.loads((ROOT / "notebooks" / f"{src.stem}.ipynb").read_text()))
    assert _cells(build.read_source(edited)) != stored


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_reader_copy_is_its_source_with_skeletons_and_no_outputs(src):
    path = ROOT / "notebooks" / "exercises" / f"{src.stem}.ipynb"
    assert path.is_file(), f"run: make notebooks NB={src.stem}"
    stored = json.loads(path.read_text())
    assert _cells(stored) == _cells(build.read_source(src, reader=True)), f"run: make notebooks NB={src.stem}"
    assert not any(c.get("outputs") for c in stored["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_book_shows_each_solution_folded_and_the_reader_its_skeleton(src):
    book, reader = build.read_source(src), build.read_source(src, reader=True)
    pairs = [(b, r) for b, r in zip(book.cells, reader.cells, strict=True) if "exercise" in b.metadata.get("tags", [])]
    # Every exercise the reader's copy shows is in one of these cells (a solution that lost its tag is not).
    assert len(pairs) == sum(r.source.count('exercises.show("') for r in reader.cells)
    for b, r in pairs:
        assert "hide-input" in b.metadata["tags"] and "NotImplementedError" not in b.source
        assert b.metadata["jupyter"]["source_hidden"] is True  # folded in JupyterLab too
        assert "raise NotImplementedError" in r.source and 'exercises.show("' in r.source
        assert b.source.splitlines()[0] == r.source.splitlines()[0]  # the same def line


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_stored_solutions_are_folded_and_no_nbval_marker_is_visible(path):
    cells = json.loads(path.read_text())["cells"]
    assert cells
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        assert "NBVAL" not in source, f"cell {i} of {path.name}: use the nbval-ignore-output tag, not a comment"
        if "exercise" in cell["metadata"].get("tags", []):
            assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True, f"cell {i} of {path.name}"


@pytest.mark.parametrize("folder", ["notebooks", "notebooks/exercises"])
def test_every_relative_link_in_the_chapters_and_the_readers_copies_resolves(folder):
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    found, broken = 0, []
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            for target in link.findall(cell.source):
                if "://" in target or target.startswith("mailto:"):
                    continue
                found += 1
                if not (path.parent / target).exists():
                    broken.append(f"{path.name}: {target}")
    assert found > 0 and not broken, broken
