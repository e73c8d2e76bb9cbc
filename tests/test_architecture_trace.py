"""docs/ARCHITECTURE.md's traces of a ZeRO-2 and a ZeRO-3 step name real code.

Each row of a trace gives a file and a function (by name, never by line); the function
must be defined in that file, so the document cannot drift from the code it walks a
reader through, and an edit that moves lines touches only the file it edits. The ZeRO-3
trace is checked against a step that runs: every engine file the step passes through is
in it. The engines' size is bounded too (base.py, each class and function, all of engines/).
"""

import ast
import re
from pathlib import Path

import pytest

from jobs import functions_a_step_runs, on_ranks

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| `([^`]+)` \|")


def trace_rows(stage: int = 2) -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split(f"## One ZeRO-{stage} step, traced", 1)[1].split("\n## ", 1)[0]
    return [(m[2], m[3]) for m in map(ROW.match, section.splitlines()) if m]


def span(path: str, qualname: str) -> tuple[int, int] | None:
    node = ast.parse((ROOT / path).read_text())
    for part in qualname.split("."):
        node = next((n for n in ast.iter_child_nodes(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def test_the_zero_2_step_is_traced_through_the_engine_files():
    rows = trace_rows()
    assert len(rows) >= 10, rows
    files = {path for path, _ in rows}
    assert "zerolearn/engines/zero2.py" in files and len(files) <= 6, sorted(files)


@pytest.mark.parametrize("stage", [2, 3])
def test_every_row_of_the_trace_names_a_function_of_its_file(stage):
    rows = trace_rows(stage)
    assert rows, "no trace rows found"
    wrong = [f"{path}: no {qualname} there" for path, qualname in rows if span(path, qualname) is None]
    assert not wrong, "\n".join(wrong)


def test_the_zero_3_trace_names_every_engine_file_a_step_runs():
    ran = {f for rank in on_ranks(functions_a_step_runs, 2, 3) for f in rank}
    engine = {(path, name) for path, name in ran if path.startswith("zerolearn/engines/")}
    assert ("zerolearn/engines/zero3.py", "Zero3Engine._pre_forward") in engine, sorted(engine)
    missing = {path for path, _ in engine} - {path for path, _ in trace_rows(3)}
    assert not missing, f"a ZeRO-3 step runs code of {sorted(missing)}, which its trace does not name"
    files = sorted({path for path, _ in engine})
    assert len(files) <= 7, f"a ZeRO-3 step runs code of {len(files)} engine files: {files}"
    assert "zerolearn/engines/zeropp_units.py" not in files and "zerolearn/engines/zero3_checks.py" not in files
    # What a reader follows: every engine function the step runs, docstrings included.
    lines = sum(last - first + 1 for first, last in (span(path, name) for path, name in engine))
    assert lines <= 1000, f"a ZeRO-3 step runs {lines} lines of engine functions"


def test_a_name_the_file_lacks_is_caught():
    assert span("zerolearn/engines/zero2.py", "Zero2Engine._reduce") is not None
    assert span("zerolearn/engines/zero2.py", "Zero2Engine._no_such_method") is None


def test_every_stage_file_reads_alone_in_at_most_250_lines():
    engines = ROOT / "zerolearn" / "engines"
    for name in ("ddp.py", "zero1.py", "zero2.py", "zero3.py"):
        tree = ast.parse((engines / name).read_text())
        lines = len((engines / name).read_text().splitlines())
        assert lines <= 250, f"{name}: {lines} lines"
        stage_bases = [b.id for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for b in node.bases
                       if isinstance(b, ast.Name)]
        assert stage_bases == ["Engine"], f"{name}: classes derive from {stage_bases}; a stage derives from Engine only"
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names
                    if node.module and node.module.startswith("zerolearn.engines.")}
        assert not imported & {"DDPEngine", "Zero1Engine", "Zero2Engine", "Zero3Engine"}, f"{name}: {imported}"


def test_zero3_units_call_nothing_of_the_engine():
    # units.py answers the engine (which units to prefetch) and never calls it.
    tree = ast.parse((ROOT / "zerolearn" / "engines" / "units.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in ast.walk(tree)
                                                                          if isinstance(a, ast.arg)}
    assert names and "engine" not in names, "units.py reaches the engine"
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "zerolearn.engines.zero3" not in imported and "zerolearn.engines.base" not in imported, imported


def test_the_engines_stay_a_size_a_reader_can_hold():
    # base.py at most 450 lines, no class over 400 nor function over 60, engines/ under 4,010 lines in all.
    engines = sorted((ROOT / "zerolearn" / "engines").glob("*.py"))
    lines = {path.name: len(path.read_text().splitlines()) for path in engines}
    assert lines["base.py"] <= 450, lines["base.py"]
    assert sum(lines.values()) < 4010, f"zerolearn/engines/ is {sum(lines.values())} lines"
    for path in engines:
        for node in ast.walk(ast.parse(path.read_text())):
            size = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef):
                assert size <= 400, f"{path.name}: class {node.name} is {size} lines"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert size <= 60, f"{path.name}: {node.name} is {size} lines"
