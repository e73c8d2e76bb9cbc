"""Three step figures draw what their chapters say: chapter 0's step ends with the gradients
freed by zero_grad(), chapter 4's recorded ZeRO-3 step ends with every unit back to its shard,
and the ring all-reduce colours a chunk by whose values it adds up, as the collectives figure
does (a rank's colour: that rank's own value; grey: a sum). Checked on the drawn artists."""

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from zerolearn.chapters.ch00 import lesson as ch00
from zerolearn.figures import schematics as S
from zerolearn.figures.schematics import collectives as C
from zerolearn.figures.schematics import zero3_units as z3
from zerolearn.figures.schematics.palette import RANK_COLORS, rank_color

pytestmark = pytest.mark.quick


def _timeline() -> list:
    """A ledger timeline of one step: gradients from backward's third event to the last (zero_grad)."""
    cats = ("params", "optimizer_states", "grads", "activations", "temporary")
    phases = ["setup"] * 2 + ["forward"] * 4 + ["backward"] * 5 + ["step"] * 3
    events = []
    for i, phase in enumerate(phases):
        by = dict.fromkeys(cats, 0) | {"params": 1024, "optimizer_states": 4096}
        by["grads"] = 2048 if 8 <= i < len(phases) - 1 else 0
        by["activations"] = 512 * (i - 1) if phase == "forward" else 0
        events.append([i, phase, sum(by.values()), by])
    return events


def _vertices_at(collection, x: float) -> set[float]:
    return {round(float(y), 6) for p in collection.get_paths() for vx, y in p.vertices if abs(vx - x) < 1e-9}


def test_chapter0_step_figure_shows_the_gradients_gone_after_zero_grad():
    timeline = _timeline()
    last = timeline[-1][0]
    fig = ch00.step_timeline_figure(timeline, "one step")
    try:
        ax = fig.axes[0]
        grads = ax.collections[2]  # stacked in order: params, optimizer_states, grads, ...
        assert grads.get_label() == "grads"
        # the last event (zero_grad) is drawn over a column of its own, where the gradients are 0 bytes thick
        assert ax.get_xlim()[1] == last + 1
        assert _vertices_at(grads, last + 1) == {(1024 + 4096) / 1024}
        assert (2048 + 1024 + 4096) / 1024 in _vertices_at(grads, last)  # just before: still there
        notes = [t for t in ax.texts if "zero_grad" in t.get_text()]
        assert len(notes) == 1 and notes[0].xy[0] == pytest.approx(last + 0.5)
    finally:
        plt.close(fig)


def test_chapter4_step_through_ends_with_every_unit_back_to_its_shard():
    sched = S.zero3_schedule()
    n = len(sched.events)
    xs, alive = z3.alive_steps(sched.events)
    # under event x's mark (x to x + 1): the bytes gathered just after it; the step leaves none
    assert xs == list(range(n + 1)) and alive[:n] == [e.alive_bytes for e in sched.events]
    assert alive[-1] == alive[-2] == 0
    last_free = {e.unit: i for i, e in enumerate(sched.events) if e.kind == "free"}
    assert sorted(last_free) == sorted(sched.units)
    assert all(sched.events[i].phase == "backward" for i in last_free.values())
    fig = Figure()
    z3.draw_zero3_frame(fig, sched)
    gathered = fig.axes[1].collections[1]
    assert gathered.get_label() == "full parameters gathered"
    assert _vertices_at(gathered, n) == {sched.shard_bytes}  # the last column: the shards alone
    end_of_forward = max(i for i, e in enumerate(sched.events) if e.phase == "forward")
    assert sched.shard_bytes + sched.events[end_of_forward].alive_bytes in _vertices_at(gathered, end_of_forward + 1)
    assert sched.events[end_of_forward].alive_bytes == 0


@pytest.mark.parametrize("nd", [3, 4])
def test_ring_colours_a_chunk_by_the_ranks_it_sums(nd):
    start, steps = S.ring_all_reduce(nd=nd)
    for i in range(len(steps) + 1):
        summed = [[(r,)] * nd for r in range(nd)] if i == 0 else steps[i - 1].summed
        values = start if i == 0 else steps[i - 1].after
        for r in range(nd):
            for c in range(nd):
                assert values[r][c] == sum(start[s][c] for s in summed[r][c])  # summed says what it adds up
        fig = Figure()
        ax = fig.add_subplot()
        C.draw_ring_step(ax, start, steps, i, legend=True)
        boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(boxes) == nd * nd
        for k, b in enumerate(boxes):
            r, c = divmod(k, nd)
            ranks = summed[r][c]
            assert b.get_facecolor() == to_rgba(C.ring_chunk_color(ranks, nd))
            # the legend of the collectives figure: a rank's colour is that rank's value, never another's
            owner = [q for q, color in enumerate(RANK_COLORS[:nd]) if to_rgba(color) == b.get_facecolor()]
            assert owner == ([ranks[0]] if len(ranks) == 1 else [])
            if len(ranks) == 1:
                assert ranks == (r,)  # in a ring all-reduce a rank's own chunk is only ever its own value
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["a rank's own value", *[f"sum of {k} ranks" for k in range(2, nd)], f"sum of all {nd} ranks"]
    # the greys: lighter the fewer ranks, the full sum the collectives figure's grey
    greys = [float(C.ring_chunk_color(tuple(range(k)), nd)) for k in range(2, nd + 1)]
    assert greys == sorted(greys, reverse=True) and len(set(greys)) == nd - 1 and greys[-1] == float(C.SUM_GREY)
    assert C.ring_chunk_color((1,), nd) == rank_color(1)
    assert all(row == [tuple(range(nd))] * nd for row in steps[-1].summed)
