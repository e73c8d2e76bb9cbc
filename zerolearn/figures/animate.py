"""Step-through animations: the frames of a schematic as a play / step control in JupyterLab
and as HTML that plays without a kernel in the built book.

:func:`step_through` takes a function that draws frame ``i`` on a figure. The same frames
become (a) an ipywidgets control (a play button and a slider over pre-drawn PNGs,
:meth:`StepThrough.widget`) and (b) matplotlib's JavaScript animation
(``Animation.to_jshtml(embed_frames=True, default_mode="once")``, :attr:`StepThrough.html`),
whose buttons step forward and back in a static page. Displayed in a notebook, a
:class:`StepThrough` shows the HTML, so a stored output plays in the book.

A stored output opened in JupyterLab without trust is sanitized: its scripts are removed,
so the player cannot start. The HTML therefore carries the first frame as a plain
``data:`` URI in the player's ``<img>`` and, under it, one line saying to run the cell to
step through; the player's controls start hidden. The player's own script removes that
line and shows the controls, so wherever scripts run (a cell just run, a trusted
notebook, the built book) the reader sees the player alone.

The HTML is deterministic: frames are PNGs without timestamps, and the random element id
matplotlib writes (``uuid4``) is replaced by a hash of the frames, so two calls with the
same frames give the same bytes. Frames are drawn at :data:`DPI` (100) and shown at their
own pixel size, one pixel per CSS pixel; keep them few (each is a base64 PNG inside the page).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from matplotlib.animation import FuncAnimation
from matplotlib.figure import Figure

from zerolearn.errors import ConfigError, require_count, require_real

__all__ = ["DPI", "STORED_NOTE", "StepThrough", "step_through"]

DPI = 100  # dots per inch of the frames, shown one image pixel per CSS pixel: 7 pt text is 10 px high
_UUID = re.compile(r"[0-9a-f]{32}")
_FIRST = re.compile(r'frames\[0\] = "(data:image/png;base64,[^"]*)"')
STORED_NOTE = "A stored picture: frame 1 of {n}. Run this cell to step through the frames."
"""The line shown under the first frame where the player's script did not run (a stored output, untrusted)."""


@dataclass
class StepThrough:
    """Frames of a schematic, ready for a notebook (:meth:`widget`) and a static page (:attr:`html`).

    Attributes:
        draw: ``draw(fig, i)`` draws frame ``i`` (0-based) on an empty ``Figure``.
        n_frames: how many frames (>= 1).
        figsize: inches (width, height); dpi: dots per inch of every frame.
        interval_ms: milliseconds between frames when playing.
        captions: one line per frame (shown under the widget's slider), or empty.
    """

    draw: Callable[[Figure, int], None]
    n_frames: int
    figsize: tuple[float, float]
    dpi: int = DPI
    interval_ms: int = 1500
    captions: list[str] = field(default_factory=list)
    _html: str | None = field(default=None, repr=False)

    def frame(self, i: int) -> Figure:
        """Frame ``i`` alone, as a ``Figure`` (0 <= i < n_frames)."""
        fig = Figure(figsize=self.figsize, dpi=self.dpi, layout="constrained")
        self.draw(fig, i)
        return fig

    def png(self, i: int) -> bytes:
        """Frame ``i`` as PNG bytes at :attr:`dpi` (no timestamp in the file)."""
        buf = io.BytesIO()
        self.frame(i).savefig(buf, format="png", dpi=self.dpi, metadata={"Software": None})
        return buf.getvalue()

    @property
    def html(self) -> str:
        """The frames as a JavaScript player (``to_jshtml``, frames embedded, plays once), computed once."""
        if self._html is None:
            fig = Figure(figsize=self.figsize, dpi=self.dpi, layout="constrained")

            def update(i: int):
                fig.clear()
                self.draw(fig, i)
                return []

            anim = FuncAnimation(fig, update, frames=self.n_frames, interval=self.interval_ms, blit=False,
                                 repeat=False, init_func=lambda: [])
            html = anim.to_jshtml(embed_frames=True, default_mode="once")
            stable = hashlib.sha256(_UUID.sub("", html).encode()).hexdigest()[:32]
            self._html = _with_static_first_frame(_UUID.sub(stable, html), stable, self.n_frames)
        return self._html

    def _repr_html_(self) -> str:
        return self.html

    def widget(self):
        """An ipywidgets box: play button and slider over the frames, the frame, its caption.

        Needs a kernel (the slider redraws from Python); the frames are drawn once, here.
        """
        import ipywidgets as w

        frames = [self.png(i) for i in range(self.n_frames)]
        play = w.Play(value=0, min=0, max=self.n_frames - 1, step=1, interval=self.interval_ms,
                      description="play")
        slider = w.IntSlider(value=0, min=0, max=self.n_frames - 1, description="step")
        w.jslink((play, "value"), (slider, "value"))
        image = w.Image(value=frames[0], format="png", layout=w.Layout(align_self="flex-start", max_width="100%"))
        caption = w.HTML(self.captions[0] if self.captions else "")

        def show(change) -> None:
            image.value = frames[change["new"]]
            if self.captions:
                caption.value = self.captions[change["new"]]

        slider.observe(show, names="value")
        return w.VBox([w.HBox([play, slider]), caption, image])


def _with_static_first_frame(html: str, uid: str, n_frames: int) -> str:
    """``html`` (matplotlib's player) with frame 0 as its image's ``src``, a note under it and
    hidden controls; a script appended to the player removes the note and shows the controls."""
    first = _FIRST.search(html)
    if first is None:  # pragma: no cover - matplotlib's template changed
        raise RuntimeError("to_jshtml: no embedded first frame found")
    src = first.group(1).replace("\\\n", "")
    img = f'<img id="_anim_img{uid}">'
    controls = '<div class="anim-controls">'
    if html.count(img) != 1 or html.count(controls) != 1:  # pragma: no cover - matplotlib's template changed
        raise RuntimeError("to_jshtml: the player's image or controls not found once")
    note = (f'<p id="_zl_note{uid}" style="font-size: 0.9em; color: #555555; margin: 4px 0;">'
            f"{STORED_NOTE.format(n=n_frames)}</p>")
    html = html.replace(img, f'<img id="_anim_img{uid}" src="{src}" alt="frame 1 of {n_frames}">\n  {note}')
    html = html.replace(controls, f'<div class="anim-controls" id="_zl_controls{uid}" style="display: none;">')
    reveal = ("<script>\n(function() {\n"
              f'  var note = document.getElementById("_zl_note{uid}");\n'
              "  if (note) { note.remove(); }\n"
              f'  var controls = document.getElementById("_zl_controls{uid}");\n'
              '  if (controls) { controls.style.display = ""; }\n'
              "})();\n</script>\n")
    return html + reveal


def step_through(draw: Callable[[Figure, int], None], n_frames: int, *, figsize: tuple[float, float] = (7.0, 3.5),
                 dpi: int = DPI, interval_ms: int = 1500, captions: list[str] | None = None) -> StepThrough:
    """Frames ``draw(fig, 0)`` ... ``draw(fig, n_frames - 1)`` as a :class:`StepThrough`.

    Args:
        draw: draws frame ``i`` on an empty matplotlib ``Figure``; must depend only on ``i``.
        n_frames: number of frames, an integer >= 1.
        figsize: (width, height) in inches, each > 0; dpi: dots per inch, an integer >= 20.
        interval_ms: milliseconds per frame when playing, an integer >= 100.
        captions: ``n_frames`` lines shown with the widget, or None.

    Raises:
        ConfigError: a count out of range, a figsize not of two sizes > 0, or captions of another length.
    """
    require_count("n_frames", n_frames)
    require_count("dpi", dpi, minimum=20)
    require_count("interval_ms", interval_ms, minimum=100)
    if not isinstance(figsize, (tuple, list)) or len(figsize) != 2:
        raise ConfigError(f"figsize: {figsize!r}; allowed: (width, height) in inches")
    for name, value in zip(("figsize width", "figsize height"), figsize, strict=True):
        require_real(name, value)
    if captions is not None and len(captions) != n_frames:
        raise ConfigError(f"captions: {len(captions)} lines for {n_frames} frames; allowed: one per frame")
    return StepThrough(draw, n_frames, tuple(figsize), dpi, interval_ms, list(captions or []))
