"""Excerpts of the package's code for the chapters: a few essential lines of a function or
class, read from the code itself when the cell runs, so that what the book shows is what
runs and cannot go stale; never a whole class.

    excerpt(Zero1Engine.step)                                   # the body, docstring left out
    excerpt(Engine._on_grad, ("def _on_grad", "self._copy_in"))  # from one line to another
    excerpt(Zero2Engine, ("def _reduce", "reduce_scatter"), ("def step", "all_gather"))

A span ``(first, last)`` runs from the first line containing ``first`` to the next line
containing ``last``, both included; several spans are joined by ``...``. An excerpt longer
than :data:`LIMIT` lines is refused: choose the lines that matter.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

LIMIT = 15
"""The most lines an excerpt shows (the book's rule: an excerpt, never a whole class)."""
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Excerpt:
    """Lines of ``where`` (``path: qualified name``), shown as a Python code block in
    JupyterLab and the book (``_repr_markdown_``) and as plain text elsewhere."""

    where: str
    lines: tuple[str, ...]

    @property
    def code(self) -> str:
        return "\n".join(self.lines)

    def __str__(self) -> str:
        return f"# {self.where}\n{self.code}"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_markdown_(self) -> str:
        return f"```python\n{self}\n```"


def _body_without_docstring(lines: list[str]) -> list[str]:
    """``lines`` (one def or class) without its docstring, when it has one."""
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = tree.body[0]
    doc = node.body[0] if node.body else None
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        return lines[:doc.lineno - 1] + lines[doc.end_lineno:]
    return lines


def _span(lines: list[str], first: str, last: str, where: str) -> list[str]:
    start = next((i for i, line in enumerate(lines) if first in line), None)
    if start is None:
        raise ValueError(f"excerpt of {where}: no line contains {first!r}")
    end = next((i for i in range(start, len(lines)) if last in lines[i]), None)
    if end is None:
        raise ValueError(f"excerpt of {where}: no line from {first!r} on contains {last!r}")
    return lines[start:end + 1]


def excerpt(obj, *spans: tuple[str, str], limit: int = LIMIT) -> Excerpt:
    """At most ``limit`` lines of the source of ``obj`` (a function, method or class of the
    package): without ``spans``, the whole definition less its docstring; else each span
    ``(first, last)``, joined by ``...``.

    Raises:
        ValueError: a span's ``first`` or ``last`` is on no line, or the excerpt has more
            than ``limit`` lines (the message says how many).
        TypeError: ``obj`` has no Python source (``inspect.getsourcelines``).
    """
    lines, _ = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj) or "?").resolve()
    shown = path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else path.name
    where = f"{shown}: {getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"
    if not spans:
        picked = _body_without_docstring(lines)
    else:
        picked = []
        for i, (first, last) in enumerate(spans):
            if i:
                picked.append("...\n")
            picked += _span(lines, first, last, where)
    text = textwrap.dedent("".join(line if line != "...\n" else "\n" for line in picked)).splitlines()
    # The "..." separators were blank for dedent; put them back at the left margin.
    at = 0
    out = []
    for line in picked:
        out.append("..." if line == "...\n" else text[at])
        at += 1
    while out and not out[-1].strip():
        out.pop()
    if len(out) > limit:
        raise ValueError(f"excerpt of {where}: {len(out)} lines, more than {limit}; "
                         "give spans (first, last) around the lines that matter")
    return Excerpt(where, tuple(out))
