"""A ZeRO file to take home: the reader's functions of chapters 1-4 and the reader's
``main()`` written out as one standalone script, ``my_zero.py``, that runs DP and
ZeRO-1/2/3 under torchrun (Sec 5.1-5.3).

The script is :mod:`zerolearn.chapters.ch04.my_zero` with each line marked ``# PART`` (an
import of one of the book's solutions) replaced by the source of the function that takes
its place, and its ``main()`` (the program: process group, model, loop) likewise: the
reader's, or the book's solution where the reader names the part in
``book_parts`` (a part neither written nor named is not written for the reader: :func:`write`
says which and writes nothing). What remains imports torch alone, so the file runs
anywhere torch does::

    write("my_zero.py", {"gather_hooks": gather_hooks, "main": main},   # yours, and the book's by name
          book_parts=["average_gradients", "flatten_params", "zero1_step", "reduce_scatter_hook"])
    # then: python -m torch.distributed.run --standalone --nproc-per-node 2 my_zero.py --stage 0 1 2 3
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path

from zerolearn.errors import ConfigError

PARTS = {"average_gradients": "01.average_gradients", "flatten_params": "02.flatten_params",
         "zero1_step": "02.zero1_step", "reduce_scatter_hook": "03.reduce_scatter_hook",
         "gather_hooks": "04.gather_hooks", "main": "04.main"}
"""The functions the script is made of, by name, and the exercise each one is."""
TEMPLATE = Path(__file__).with_name("my_zero.py")


def part_source(name: str, fn: Callable | None = None) -> str:
    """The source of part ``name``: ``fn``'s (a function defined in a notebook cell or a file;
    a known bug built by :func:`zerolearn.exercises.core.edited` is renamed ``name``), or, when
    ``fn`` is None, the book's solution with its markers removed. Raises ConfigError
    for a name not in :data:`PARTS`, or a function whose name differs or whose source is lost."""
    from zerolearn.exercises.core import solution_source

    if name not in PARTS:
        raise ConfigError(f"part {name!r}: allowed are {', '.join(PARTS)}")
    if fn is None:
        return solution_source(PARTS[name])
    own = getattr(fn, "__name__", None)
    if own != name and getattr(getattr(fn, "edited_from", None), "__name__", None) != name:
        raise ConfigError(f"part {name!r} is a function named {getattr(fn, '__name__', fn)!r}; "
                          f"the script calls {name}(...)")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise ConfigError(f"the source of {name} cannot be read ({e}): define it with def in a cell") from e
    return source if own == name else source.replace(f"def {own}(", f"def {name}(", 1)  # a known bug, renamed


def written(parts: dict[str, Callable] | None) -> dict[str, Callable]:
    """The parts of ``parts`` the reader has written: a function whose body still raises
    NotImplementedError (the reader's copy's skeleton) is left out, so the book's solution
    takes its place. Raises ConfigError naming a part not in :data:`PARTS`."""
    parts = dict(parts or {})
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ConfigError(f"parts: {', '.join(map(repr, unknown))} unknown; allowed are {', '.join(PARTS)}")
    return {n: fn for n, fn in parts.items() if "raise NotImplementedError" not in part_source(n, fn)}


def unwritten(parts: dict[str, Callable] | None, book_parts=()) -> list[str]:
    """The parts neither written by the reader (:func:`written`) nor named in ``book_parts``, as
    'name (exercise NN.name)'. Raises ConfigError naming a part not in :data:`PARTS`."""
    unknown = sorted(set(book_parts) - set(PARTS))
    if unknown:
        raise ConfigError(f"book_parts: {', '.join(map(repr, unknown))} unknown; allowed are {', '.join(PARTS)}")
    yours = written(parts)
    return [f"{n} (exercise {PARTS[n]})" for n in PARTS if n not in yours and n not in book_parts]


def _main_lines(text: str) -> tuple[int, int]:
    """The 0-based first line and the end (exclusive) of the template's ``def main``."""
    found = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    return found[0].lineno - 1, found[0].end_lineno


def script(parts: dict[str, Callable] | None = None) -> str:
    """The text of ``my_zero.py``: the template with every ``# PART`` line replaced, the first by
    the sources of the functions it imports (the reader's :func:`written` ones, the book's
    solutions for the rest), the others removed, and its ``main()`` by the reader's or the
    book's (markers removed); ``BOOK_PARTS`` lists the book's, which the script prints when it runs."""
    parts = written(parts)
    text = TEMPLATE.read_text()
    first, end = _main_lines(text)
    lines = text.splitlines()
    lines[first:end] = part_source("main", parts.get("main")).rstrip().splitlines()
    out, written_yet = [], False
    for line in lines:
        if line.startswith("BOOK_PARTS = "):
            books = [n for n in PARTS if n not in parts]
            out.append(f"BOOK_PARTS = {books!r}  # the parts that are the book's solutions, not yours")
        elif not line.endswith("# PART"):
            out.append(line)
        elif not written_yet:
            out.append("\n\n\n".join(part_source(n, parts.get(n)).rstrip() for n in PARTS if n != "main"))
            written_yet = True
    return "\n".join(out) + "\n"


def write(path: str | Path, parts: dict[str, Callable] | None = None, book_parts=()) -> str:
    """Write :func:`script` to ``path`` when every part is the reader's (``parts``, written) or
    named in ``book_parts`` (the book's solution, asked for by name). Returns one line saying
    which parts are the reader's and which the book's, or, writing nothing, which parts are
    not written yet and their exercises. Raises ConfigError naming an unknown part."""
    missing = unwritten(parts, book_parts)
    if missing:
        return (f"not written yet: {', '.join(missing)}; write them above, or name them in book_parts= to take "
                f"the book's solutions ({path} not written)")
    Path(path).write_text(script(parts))
    yours = written(parts)
    books = [n for n in PARTS if n not in yours]
    return (f"wrote {path}: yours {', '.join(yours) or 'none'}; "
            f"the book's solution for {', '.join(books) or 'none'}")
