"""Interactive explorers (ipywidgets + matplotlib) over the memory model and measured runs.

Eight explorers, each a ``VBox`` to ``display``: its ``controls`` (a dict of widgets
by name), a ``summary`` (HTML with the numbers) and a ``view`` (the figure as a PNG
image). Changing any control's ``value`` recomputes ``result`` (the numbers shown,
in bytes) and redraws. The arithmetic and the figures live in :mod:`zerolearn.figures`
as pure functions, so tests check them without a browser and the built book shows
each default view as a static figure.

* :class:`MemoryExplorer` - bytes per device of each stage by category (Sec 3, 5, Fig 1)
* :class:`FitSolver` - the fewest GPUs, then the lowest stage, that fit a model
* :class:`TradeOff` - memory per device against communication per step (Sec 5, 7)
* :class:`TimelineViewer` - a measured ``--memory-timeline`` step, per stage
* :class:`FragmentationSimulator` - Sec 6.3's fragmentation and MD in a simulated allocator
* :class:`StageExplorer` - one stage beside DP, bytes by category and traffic (chapters 2-4)
* :class:`ResidualExplorer` - ZeRO-R: P_a, P_a+cpu, CB and MD per GPU under Nm (chapter 5)
* :class:`BeyondExplorer` - stages 1-3 with CPU or disk offload: what fits, and the step time
  (chapter 8; an HTML table, no figure)

The first three live in :mod:`~zerolearn.widgets.formulas`, the next two in
:mod:`~zerolearn.widgets.measured`, the chapters' views in :mod:`~zerolearn.widgets.stage`
and :mod:`~zerolearn.widgets.beyond`; :mod:`~zerolearn.widgets.base` holds what they share.
"""

from zerolearn.widgets.beyond import BeyondExplorer
from zerolearn.widgets.formulas import FitSolver, MemoryExplorer, TradeOff
from zerolearn.widgets.measured import FragmentationSimulator, TimelineViewer
from zerolearn.widgets.stage import ResidualExplorer, StageExplorer

__all__ = ["BeyondExplorer", "FitSolver", "FragmentationSimulator", "MemoryExplorer", "ResidualExplorer",
           "StageExplorer", "TimelineViewer", "TradeOff"]
