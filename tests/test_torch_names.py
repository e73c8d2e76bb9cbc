"""torch 2.13's collective names, unsilenced: the package, the chapters and the docs write
``dist.reduce_scatter_single`` and ``dist.all_gather_single``; they run without the FutureWarning
that the deprecated names print; nothing in the project hides torch's warnings."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
DEPRECATED = re.compile(r"\b(?:dist|torch\.distributed|compat)\.(reduce_scatter_tensor|all_gather_into_tensor)\b")


def written_text() -> list[Path]:
    """The files a reader reads or runs: the package, the chapter sources and stored chapters,
    the readers' copies, the book's pages and the docs."""
    files = [*ROOT.glob("zerolearn/**/*.py"), *ROOT.glob("notebooks/src/*.py"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("notebooks/exercises/*.ipynb"), *ROOT.glob("book/*.md"), *ROOT.glob("docs/*.md"),
             ROOT / "README.md"]
    return [f for f in files if f.name != "compat.py"]


def test_no_deprecated_collective_name_is_written():
    files = written_text()
    assert len(files) > 100, len(files)
    found = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in DEPRECATED.finditer(f.read_text())]
    assert found == []


def test_the_current_names_run_without_a_warning_after_importing_the_chapters():
    """On a fresh process with every warning an error: one gloo rank reduce-scatters and
    all-gathers by torch 2.13's names (on torch 2.11 the names come from zerolearn.compat)."""
    script = textwrap.dedent("""
        import os, warnings
        warnings.simplefilter("error")
        import torch, torch.distributed as dist
        import zerolearn.chapters  # noqa: F401
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        out = torch.empty(4)
        dist.reduce_scatter_single(out, torch.arange(4.0))
        full = torch.empty(4)
        dist.all_gather_single(full, out)
        print(full.tolist())
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0.0, 1.0, 2.0, 3.0]"
    assert "Warning" not in done.stderr, done.stderr


def test_the_deprecated_name_still_warns_under_the_pinned_torch():
    """The reason for the names: if torch stopped warning, this test says the text can relax."""
    import torch

    if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        pytest.skip("torch before 2.13 knows only the old names")
    script = textwrap.dedent("""
        import warnings
        import torch, torch.distributed as dist
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2))
        print(sum(issubclass(w.category, FutureWarning) and "reduce_scatter_single" in str(w.message) for w in caught))
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_no_warning_of_torch_is_silenced_by_configuration():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert all("torch" not in entry for entry in options.get("filterwarnings", [])), options["filterwarnings"]
    package = list(ROOT.glob("zerolearn/**/*.py"))
    silenced = [f"{f.relative_to(ROOT)}" for f in package
                if re.search(r"filterwarnings\(\s*\"ignore\"", f.read_text())]
    assert silenced == []


def test_make_test_runs_every_chapter_with_future_warnings_as_errors():
    """The chapters' passes (stored chapters, strict; readers' copies, lax) run their kernels, and the
    ranks those start, with every FutureWarning an error: no deprecated torch call is left in them."""
    recipe = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    passes = [line for line in recipe.splitlines() if "--nbval" in line]
    assert len(passes) == 2, passes
    assert all("PYTHONWARNINGS=error::FutureWarning" in line for line in passes), passes
