"""The one table formatter: every table the package prints goes through :func:`text_table`.

Built on `tabulate <https://github.com/astanin/python-tabulate>`_. Numbers are shown
exactly as the caller formatted them: tabulate's own number parsing is switched off,
so a cell keeps the precision docs/ARCHITECTURE.md asks for ("Measurement conventions") (bytes and counts exact, bf16
to 3 significant digits), and a stored notebook output does not depend on tabulate's
rounding. Importing this module does not import torch (the memory CLI uses it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tabulate as _tabulate

__all__ = ["cell", "kib", "text_table"]


def cell(value: object) -> str:
    """One cell as text: an int with thousands separators (``1,070``), ``None`` as "-",
    anything else (str, a float the caller did not format) with ``str()``. Spaces are kept."""
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def kib(nbytes: float | None, *, unit: bool = False) -> str:
    """Bytes as KiB (2**10 bytes), one decimal and thousands separators: ``"1.5"`` for a
    table cell whose header names the unit, ``"1.5 KiB"`` with ``unit`` (for a sentence);
    ``None`` (nothing measured) is ``"-"``. The package's one formatter of KiB."""
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**10:,.1f}" + (" KiB" if unit else "")


def text_table(header: Sequence[str], rows: Iterable[Sequence], *, fmt: str = "simple",
               align: str | Sequence[str] = "right") -> str:
    """``rows`` under ``header`` as one string, columns aligned.

    Args:
        header: one name per column; a name with "\\n" makes a two-line header
            (e.g. "params KiB\\nmeasured").
        rows: one sequence of cells per row, each cell shown by :func:`cell`; a row
            may be shorter than the header (its last cells are left empty).
        fmt: a tabulate format: "simple" (text, a dashed rule under the header),
            "html" (the explorers of :mod:`zerolearn.widgets`), "pipe" (Markdown).
        align: "right", "left" or "center" for every column, or one per column.

    Raises:
        ValueError: a row longer than the header, or ``align`` of the wrong length.
    """
    header = list(header)
    cells = [[cell(c) for c in row] for row in rows]
    if any(len(row) > len(header) for row in cells):
        raise ValueError(f"a row has more cells than the header's {len(header)}")
    cells = [row + [""] * (len(header) - len(row)) for row in cells]
    colalign = [align] * len(header) if isinstance(align, str) else list(align)
    if len(colalign) != len(header):
        raise ValueError(f"align has {len(colalign)} entries for {len(header)} columns")
    # tabulate widens every column by 2 beyond its header (MIN_PADDING, a module global with
    # no argument); columns as wide as their widest cell keep tables narrow. Whitespace is
    # kept: a caller's trailing space can keep digits aligned next to a marked cell.
    saved, _tabulate.MIN_PADDING = _tabulate.MIN_PADDING, 0
    try:
        return _tabulate.tabulate(cells, headers=header, tablefmt=fmt, colalign=colalign, disable_numparse=True,
                                  preserve_whitespace=True)
    finally:
        _tabulate.MIN_PADDING = saved
