"""Build the chapter notebooks from their jupytext sources and execute them in order.

    python notebooks/build.py                 # every chapter, in reading order
    python notebooks/build.py 02_zero1        # one chapter (name or path)
    python notebooks/build.py --readers       # only the reader's copies (no execution)

Each chapter's source is a percent script in ``notebooks/src/`` (``# %%`` starts a code
cell, ``# %% [markdown]`` a text cell). The notebook is written beside it in
``notebooks/`` after a real, top-to-bottom run in a fresh kernel (nbclient), so the
stored outputs are what the code prints. Cell ids are numbered, not random, so a
rebuild that prints the same changes nothing in git. ``tests/test_notebooks_meta.py``
fails when a stored notebook's cells differ from its source.

An exercise is a code cell tagged ``exercise`` whose source is one line,
``# exercise: 02.zero1_step``. The executed book gets the exercise's reference solution
there (from :mod:`zerolearn.exercises`), folded: by the ``hide-input`` tag in the HTML book
and by ``metadata.jupyter.source_hidden`` in JupyterLab. The
reader's copy in ``notebooks/exercises/`` gets the skeleton: the same signature and
docstring with ``raise NotImplementedError`` for a body (for a program exercise, the
``%%writefile`` cell of a script whose ``main()`` is left to write). A cell tagged
``reader-types`` holds a shell line (``!... torch.distributed.run ...``) that the reader's
copy replaces by a line saying to type it. A cell whose printed figures change with the machine
carries the ``nbval-ignore-output`` tag (``# %% tags=["nbval-ignore-output"]`` in the
source), so nbval runs it without comparing its output. Reader's copies are written
unexecuted; their ``check`` cells say "not written yet" until the reader fills them in.
"""

import re
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
READERS = HERE / "exercises"
EXERCISE = re.compile(r"# exercise: (\d\d\.\w+)")
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
# IPython's lexer: the book highlights a cell's shell escape (!torchrun ...) without a warning.
LANGUAGE_INFO = {"name": "python", "pygments_lexer": "ipython3"}


# A cell tagged reader-types holds a shell line (# !torchrun ...) that the reader's copy leaves to the reader.
READER_TYPES = re.compile(r"^!.*$", re.M)  # jupytext reads "# !" as "!"
TYPE_HERE = "# type the line here (the text above says how), starting with !"


def sources() -> list[Path]:
    """The chapter sources in reading order (file names sort as the chapters do)."""
    return sorted(SRC.glob("[0-9]*.py"))


# A markdown link to a file outside notebooks/ (../book/...): the readers' copies need one more ../.
RELATIVE_LINK = re.compile(r"\]\((\.\./)")


def read_source(src: Path, reader: bool = False) -> nbformat.NotebookNode:
    """The notebook a source describes, unexecuted, with numbered cell ids: with each
    exercise's solution (the book) or, ``reader=True``, its skeleton (the reader's copy).
    Raises ValueError naming the cell when an exercise cell is malformed."""
    from zerolearn import exercises

    nb = jupytext.read(src, fmt="py:percent")
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO}
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i:02d}"
        cell.metadata.pop("lines_to_next_cell", None)
        if reader and cell.cell_type == "markdown":  # the copy sits one folder deeper
            cell.source = RELATIVE_LINK.sub(r"](../\1", cell.source)
        tags = cell.metadata.get("tags", [])
        if reader and "reader-types" in tags:  # a shell line the reader types: the copy keeps only the code
            cell.source = READER_TYPES.sub(TYPE_HERE, cell.source)
            continue
        if "exercise" not in tags:
            continue
        found = EXERCISE.fullmatch(cell.source.strip())
        if not found:
            raise ValueError(f"{src.name}, cell {i}: an exercise cell holds one line '# exercise: NN.name', "
                             f"not {cell.source[:60]!r}")
        name = found.group(1)
        if reader:
            cell.source = f'{exercises.skeleton(name)}\n\n# Stuck? exercises.show("{name}") prints a solution.'
        else:
            cell.source = exercises.solution_source(name)
            cell.metadata["tags"] = [*tags, "hide-input"]
            cell.metadata["jupyter"] = {"source_hidden": True}  # folded in JupyterLab, as in the book
    return nb


def write_reader_copy(src: Path) -> Path:
    """Write ``notebooks/exercises/<name>.ipynb``: the chapter with skeletons, no outputs."""
    READERS.mkdir(exist_ok=True)
    out = READERS / f"{src.stem}.ipynb"
    nbformat.write(read_source(src, reader=True), out)
    return out


WRITTEN_BY_CHAPTERS = ("allreduce.py", "my_zero.py")
"""The scripts chapters write beside themselves (``%%writefile``, the take-home); git ignores them."""


def build(src: Path, timeout: int = 600) -> Path:
    """Execute ``src`` in a fresh python3 kernel with ``notebooks/`` as working directory
    and write ``notebooks/<name>.ipynb``. Raises nbclient's CellExecutionError, naming
    the cell, when a cell fails."""
    nb = read_source(src)
    for name in WRITTEN_BY_CHAPTERS:  # a fresh run: %%writefile says "Writing", as in CI's clean clone
        (HERE / name).unlink(missing_ok=True)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    nb.metadata["language_info"] = LANGUAGE_INFO  # the kernel's version string differs per machine
    out = HERE / f"{src.stem}.ipynb"
    nbformat.write(nb, out)
    return out


def main(argv: list[str]) -> None:
    readers_only = "--readers" in argv
    argv = [a for a in argv if a != "--readers"]
    chosen = [SRC / f"{Path(a).stem}.py" for a in argv] or sources()
    for src in chosen:
        if not src.is_file():
            names = ", ".join(p.stem for p in sources())
            sys.exit(f"no chapter source {src}; chapters are: {names}")
        print("wrote", write_reader_copy(src).relative_to(HERE.parent), flush=True)
        if not readers_only:
            print("wrote", build(src).relative_to(HERE.parent), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
