"""What every explorer shares: the controls, the HTML table, the figure as a PNG, and
:class:`Explorer` (controls, a summary and a figure, refreshed on every change)."""

from __future__ import annotations

import contextlib
import io

import ipywidgets as w

from zerolearn import figures
from zerolearn.memory.model import GB, STAGE_NAMES
from zerolearn.tables import text_table

__all__ = ["DPI", "MIB", "STAGES", "STORED_NOTE", "STYLE", "WIDE", "Explorer", "dtype_menu", "gb", "html_table",
           "nd_slider", "optimizer_menu", "png", "psi_slider"]

STYLE = {"description_width": "150px"}
WIDE = w.Layout(width="420px")
STAGES = [(f"{s} {name}", s) for s, name in STAGE_NAMES.items()]
MIB = 2**20


def gb(nbytes: float) -> str:
    """Bytes in the paper's decimal GB, as the summaries print them."""
    return f"{nbytes / GB:,.2f} GB"


def psi_slider(value: float) -> w.FloatLogSlider:
    # continuous_update=False: the browser's slider snaps its first position to the
    # step grid and, when updating continuously, sends that back (7.5e9 would become
    # 10**9.88 = 7.59e9 as soon as the view is drawn); without it only a move by the
    # reader changes the value.
    return w.FloatLogSlider(value=value, base=10, min=8, max=12, step=0.01, description="Psi (parameters)",
                            readout_format=".3g", continuous_update=False, style=STYLE, layout=WIDE)


def nd_slider(value: int) -> w.SelectionSlider:
    return w.SelectionSlider(options=figures.NDS, value=value, description="Nd (data parallel)", style=STYLE,
                             layout=WIDE)


def optimizer_menu() -> w.Dropdown:
    return w.Dropdown(options=["adam", "adamw", "sgd"], value="adam", description="optimizer", style=STYLE)


def dtype_menu() -> w.Dropdown:
    return w.Dropdown(options=["bf16", "fp16", "fp32"], value="bf16", description="working dtype", style=STYLE)


STORED_NOTE = "(an explorer: run this cell to use its controls)"
"""The line under an explorer's text form: what a stored notebook shows until its cell runs again."""
DPI = 100  # the figure's pixels are shown one to one (see Explorer): sharp text, no rescaling


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def html_table(header: list[str], rows: list[list[str]]) -> str:
    """``rows`` as an HTML table (:func:`zerolearn.tables.text_table`), cells right-aligned and spaced."""
    return text_table(header, rows, fmt="html").replace('style="text-align: ', 'style="padding: 0 8px; text-align: ')


class Explorer(w.VBox):
    """Controls, a summary and a figure; ``refresh`` runs on every change of a control."""

    def __init__(self, controls: dict[str, w.Widget]):
        self.controls = controls
        # The image at its own size (a box stretches its children to full width by
        # default, which blurs the figure), but never wider than the output.
        self.summary = w.HTML()
        self.view = w.Image(format="png", layout=w.Layout(align_self="flex-start", max_width="100%"))
        self.result: dict = {}
        self._held = False
        self._drawing = True
        grid = w.GridBox(list(controls.values()), layout=w.Layout(grid_template_columns="repeat(2, 440px)"))
        super().__init__([grid, self.summary, self.view])
        for control in controls.values():
            control.observe(lambda _: None if self._held else self.refresh(), names="value")
        self.refresh()

    @contextlib.contextmanager
    def hold(self):
        """Change several controls at once: one refresh at the end, not one per change."""
        self._held = True
        try:
            yield self
        finally:
            self._held = False
            self.refresh()

    @contextlib.contextmanager
    def figure_deferred(self):
        """Controls moved inside this block update ``result`` and the summary at once and
        the figure once, at the end (drawing is most of a refresh's time: for sweeps)."""
        self._drawing = False
        try:
            yield self
        finally:
            self._drawing = True
            self.refresh()

    def __repr__(self) -> str:  # short and stable: notebooks store it as the widget's text
        return f"{type(self).__name__}({', '.join(f'{k}={c.value!r}' for k, c in self.controls.items())})"

    def _repr_mimebundle_(self, **kwargs):
        """The widget's view and, as its text form, its name and settings and :data:`STORED_NOTE`.

        The text is what a stored notebook shows where the view cannot be drawn: JupyterLab
        with the notebook untrusted (widget views are not sanitizable) or no kernel behind it.
        """
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle and "text/plain" in bundle:
            bundle["text/plain"] = f"{bundle['text/plain']}\n{STORED_NOTE}"
        return bundle

    def value(self, name: str):
        return self.controls[name].value

    def refresh(self) -> None:
        self.result = self.compute()
        # The figure first, the summary last: the browser applies them in order, so a
        # summary on the page is never ahead of the figure under it.
        if self._drawing:
            self.view.value = png(self.figure())
        self.summary.value = self.describe(self.result)

    def compute(self) -> dict:  # pragma: no cover - every explorer overrides these
        raise NotImplementedError

    def describe(self, result: dict) -> str:  # pragma: no cover
        raise NotImplementedError

    def figure(self):  # pragma: no cover
        raise NotImplementedError
