"""Write a chapter notebook from a list of cells, then execute it in place.

    python notebooks/src/_nb.py notebooks/src/02_zero1.py

A build script defines ``CELLS``: a list of ("md" | "code", source) pairs. The
notebook is written to ``OUT`` (relative to the script, e.g. "../02_zero1.ipynb") and executed with nbclient, so
stored outputs come from a real, in-order run.
"""

import runpy
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def build(script: str) -> Path:
    spec = runpy.run_path(script)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in spec["CELLS"]:
        source = source.strip("\n")
        nb.cells.append(nbformat.v4.new_markdown_cell(source) if kind == "md"
                        else nbformat.v4.new_code_cell(source))
    out = Path(script).parent / spec["OUT"]
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(out.parent)}}).execute()
    nbformat.write(nb, out)
    return out


if __name__ == "__main__":
    for script in sys.argv[1:]:
        print("wrote", build(script))
