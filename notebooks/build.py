"""Build the chapter notebooks from their jupytext sources and execute them in order.

    python notebooks/build.py                 # every chapter, in reading order
    python notebooks/build.py 02_zero1        # one chapter (name or path)

Each chapter's source is a percent script in ``notebooks/src/`` (``# %%`` starts a code
cell, ``# %% [markdown]`` a text cell). The notebook is written beside it in
``notebooks/`` after a real, top-to-bottom run in a fresh kernel (nbclient), so the
stored outputs are what the code prints. Cell ids are numbered, not random, so a
rebuild that prints the same changes nothing in git. ``tests/test_notebooks_meta.py``
fails when a stored notebook's cells differ from its source.
"""

import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def sources() -> list[Path]:
    """The chapter sources in reading order (file names sort as the chapters do)."""
    return sorted(SRC.glob("[0-9]*.py"))


def read_source(src: Path) -> nbformat.NotebookNode:
    """The notebook a source describes, unexecuted, with numbered cell ids."""
    nb = jupytext.read(src, fmt="py:percent")
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i:02d}"
        cell.metadata.pop("lines_to_next_cell", None)
    return nb


def build(src: Path, timeout: int = 600) -> Path:
    """Execute ``src`` in a fresh python3 kernel with ``notebooks/`` as working directory
    and write ``notebooks/<name>.ipynb``. Raises nbclient's CellExecutionError, naming
    the cell, when a cell fails."""
    nb = read_source(src)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    nb.metadata["language_info"] = {"name": "python"}  # the kernel's version string differs per machine
    out = HERE / f"{src.stem}.ipynb"
    nbformat.write(nb, out)
    return out


def main(argv: list[str]) -> None:
    chosen = [SRC / f"{Path(a).stem}.py" for a in argv] or sources()
    for src in chosen:
        if not src.is_file():
            names = ", ".join(p.stem for p in sources())
            sys.exit(f"no chapter source {src}; chapters are: {names}")
        print("wrote", build(src).relative_to(HERE.parent), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
