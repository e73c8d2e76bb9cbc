"""The paper map: every numbered claim of the ZeRO paper, what zerolearn computes for it, and its status.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC'20 (arXiv 1910.02054). One :class:`Row` per claim, in the
paper's order (Sec 1-10, Fig 1, Tables 1-3). The numbers in the "zerolearn computes"
column are not typed in: each is computed here by calling the package's own cited
functions (``zerolearn.memory.model``, ``zerolearn.memory.fit``, ``zerolearn.costmodel``,
``zerolearn.chapters.ch06.lesson``), so the page ``book/paper_map.md`` cannot drift from the
code. ``make paper-map`` (``python -m zerolearn.papermap > book/paper_map.md``)
regenerates it; a test fails when the committed page differs from :func:`render`.

The page's header states the status rule: "reproduced" only when the package's computation
at the paper's own stated inputs holds each number the paper states within the row's
tolerance (:class:`Stated`; :func:`zerolearn.papermap.checks.paper_rule_problems`).

A second table, "Beyond the paper", maps the headline claims of ZeRO's successors
(ZeRO-Offload, ZeRO-Infinity, ZeRO++) the same way (chapter 8).

Modules: :mod:`~zerolearn.papermap.base` (:class:`Row`, statuses, printing),
:mod:`~zerolearn.papermap.sec1_5` and :mod:`~zerolearn.papermap.sec6_10` (the claims),
:mod:`~zerolearn.papermap.successors` (the successors' claims),
:mod:`~zerolearn.papermap.page` (the page and its notes).
"""

from zerolearn.papermap.base import NOT_REPRODUCIBLE, REPRODUCED, SHAPE_ONLY, STATUSES, Row, Stated
from zerolearn.papermap.page import find, render, rows

__all__ = ["NOT_REPRODUCIBLE", "REPRODUCED", "SHAPE_ONLY", "STATUSES", "Row", "Stated", "find", "render", "rows"]
