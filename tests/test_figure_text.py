"""Every figure zerolearn.figures draws reads: each label lies inside the figure and no two
labels overlap, measured on the drawn text's bounding boxes; step-through frames are drawn
at 100 dpi or more at the size they are shown."""

import base64
import functools
import io
import itertools
import json
import re
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from PIL import Image

from zerolearn import figures
from zerolearn.figures import animate
from zerolearn.figures import schematics as S
from zerolearn.figures import timeline as tl

pytestmark = pytest.mark.slow  # every chapter figure drawn

DATA = Path(__file__).resolve().parent.parent / "notebooks" / "data"
TOLERANCE = 1.0  # pixels: anti-aliasing at a box's edge is not an overlap


def stored(*parts: str) -> dict:
    return json.loads((DATA.joinpath(*parts)).read_text())


def synthetic_report(stage: int = 3) -> dict:
    """A --memory-timeline report of one made-up step: setup, forward, backward, step."""
    cats = ("params", "grads", "optimizer_states", "activations", "temporary")
    events, phases = [], ["setup"] * 2 + ["forward"] * 4 + ["backward"] * 5 + ["step"] * 3
    for i, phase in enumerate(phases):
        by = {c: (k + 1) * 1024 * (1 + i % 3) for k, c in enumerate(cats)}
        events.append([i, phase, sum(by.values()), by])
    return {"ranks": [{"memory": {"timeline": events}}], "config": {"stage": stage}, "world_size": 2}


@functools.lru_cache(maxsize=1)
def zero3_sched():
    return S.zero3_schedule()


FIGURES = {
    "memory_figure": lambda: figures.memory_figure(),
    "fit_figure": lambda: figures.fit_figure(),
    "tradeoff_figure": lambda: figures.tradeoff_figure(),
    "stage_figure 1": lambda: figures.formulas.stage_figure(stage=1),
    "stage_figure 3": lambda: figures.formulas.stage_figure(stage=3),
    "residual_figure": lambda: figures.formulas.residual_figure(),
    "timeline_figure": lambda: figures.timeline_figure(synthetic_report()),
    "fragmentation_figure": lambda: figures.fragmentation_figure(),
    "stage_timelines_figure": lambda: tl.stage_timelines_figure(stored("timeline", "stages.json")),
    "sweep_timelines_figure": lambda: tl.sweep_timelines_figure(stored("timeline", "bucket_sweep.json")),
    "bucket_sweep_figure": lambda: tl.bucket_sweep_figure(stored("timeline", "bucket_sweep.json")),
    "prefetch_figure": lambda: tl.prefetch_figure(stored("timeline", "prefetch.json")),
    "scaling_figure": lambda: figures.scaling_figure(DATA / "bench" / "scaling.json"),
    "model_states_figure": lambda: S.model_states_figure(3),
    "offload_figure": lambda: S.offload_figure(),
    "collectives_figure": lambda: S.collectives_figure(3),
    "ring_figure": lambda: S.ring_figure(3),
    "zero1_figure": lambda: S.zero1_figure(),
    "bucket_schedule_figure": lambda: S.bucket_schedule_figure(stage=2),
    "zero3_figure": lambda: S.zero3_figure(zero3_sched()),
    "megatron_figure": lambda: S.megatron_figure(),
    "zeropp_figure": lambda: S.zeropp_figure(),
}

ANIMATIONS = {
    "ring_animation": lambda: S.ring_animation(3),
    "zero1_animation": lambda: S.zero1_animation(nd=3),
    "zero3_animation": lambda: S.zero3_animation(zero3_sched()),
}


def texts(fig: Figure) -> list[tuple[str, object]]:
    """Every visible, non-empty text of ``fig`` once drawn, with its bounding box in pixels."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    undrawn = set()  # tick labels of ticks outside the view: matplotlib keeps them but does not draw them
    for ax in fig.axes:
        for axis in ax._axis_map.values():
            ticks = axis.get_major_ticks() + axis.get_minor_ticks()
            drawn = {id(t) for t in axis._update_ticks()} if ax.axison else set()
            if not ax.axison:  # ax.axis("off"): no ticks, no axis labels
                undrawn.add(id(axis.label))
            undrawn |= {id(label) for t in ticks if id(t) not in drawn for label in (t.label1, t.label2)}
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.get_alpha() != 0 and id(t) not in undrawn:
            out.append((t.get_text(), t.get_window_extent(renderer)))
    return out


def problems(fig: Figure) -> list[str]:
    """Labels outside the figure or overlapping another label, named."""
    canvas = fig.bbox
    found, boxes = [], texts(fig)
    for text, b in boxes:
        if (b.x0 < canvas.x0 - TOLERANCE or b.y0 < canvas.y0 - TOLERANCE or b.x1 > canvas.x1 + TOLERANCE
                or b.y1 > canvas.y1 + TOLERANCE):
            found.append(f"{text!r} outside the figure: {tuple(round(v) for v in b.extents)} in "
                         f"{tuple(round(v) for v in canvas.extents)}")
    for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        if w > TOLERANCE and h > TOLERANCE:
            found.append(f"{ta!r} overlaps {tb!r} by {w:.0f} x {h:.0f} px")
    return found


SLOW_FIGURES = {"fragmentation_figure"}  # records a training run's allocations, searches the smallest arena: ~25 s


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_FIGURES else n
                                  for n in FIGURES])
def test_figure_labels_are_inside_and_apart(name):
    assert problems(FIGURES[name]()) == []


@pytest.mark.parametrize("name", list(ANIMATIONS))
def test_every_frame_of_a_step_through_reads(name):
    anim = ANIMATIONS[name]()
    assert anim.n_frames >= 2  # a step-through steps
    for i in range(anim.n_frames):
        assert problems(anim.frame(i)) == [], f"frame {i}"


@pytest.mark.parametrize("name", list(ANIMATIONS))
def test_frames_are_at_least_100_dpi_at_their_display_size(name):
    """The player shows a frame at its own pixel size (one image pixel per CSS pixel), the
    figure's inches at the frame's dpi: the pixels per inch shown are the dpi drawn."""
    anim = ANIMATIONS[name]()
    width, height = Image.open(io.BytesIO(anim.png(0))).size
    assert anim.dpi >= 100 and animate.DPI >= 100
    assert width >= 100 * anim.figsize[0] - 1 and height >= 100 * anim.figsize[1] - 1


def test_a_stored_step_through_shows_its_first_frame_without_scripts():
    """Without its scripts (a stored output opened untrusted in JupyterLab) the player's image
    still has its first frame as a data URI, a line says to run the cell, and the dead controls
    are hidden; the script that runs elsewhere removes the line and shows the controls."""
    anim = S.ring_animation(3)
    html = anim.html
    without_scripts = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    img = re.search(r'<img id="_anim_img(\w+)" src="(data:image/png;base64,[A-Za-z0-9+/=]+)"', without_scripts)
    assert img is not None
    uid = img.group(1)
    first = Image.open(io.BytesIO(base64.b64decode(img.group(2).split(",", 1)[1])))
    assert first.size == Image.open(io.BytesIO(anim.png(0))).size
    assert animate.STORED_NOTE.format(n=anim.n_frames) in without_scripts
    assert f'id="_zl_controls{uid}" style="display: none;"' in without_scripts
    assert f'getElementById("_zl_note{uid}")' in html and "note.remove()" in html
