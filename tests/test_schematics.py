"""The schematics draw the package's own state: the data behind each drawing is checked
against FlatLayout, the paper's formulas, single-process SGD, a recorded ZeRO-3 step, the
tensor-parallel modules and the comm ledger's model. Pixels are not checked; that every
drawing draws is."""

import dataclasses

import pytest
import torch
from matplotlib.figure import Figure

from zerolearn import comm
from zerolearn.errors import ConfigError
from zerolearn.figures import schematics as S
from zerolearn.figures.animate import step_through
from zerolearn.figures.schematics import zero3_units as z3
from zerolearn.flat import FlatLayout
from zerolearn.memory.model import model_state_bytes, offload_state_bytes

pytestmark = pytest.mark.slow  # every schematic animated


def test_at_nd3_stage2_rank1_holds_its_flatlayout_shard_of_grads_and_optimizer_states():
    data = S.model_states(3)
    shapes = [torch.Size(s) for s in S.states.DEFAULT_SHAPES.values()]
    layout = FlatLayout.of(list(S.states.DEFAULT_SHAPES), shapes, 3, 1)
    held = {(s.category, s.start, s.end) for s in data.slices[2][1] if s.held}
    assert {(c, *layout.shard_range) for c in ("grads", "optimizer_states")} <= held
    assert {("params", *FlatLayout.of(list(S.states.DEFAULT_SHAPES), shapes, 3, r).shard_range)
            for r in range(3)} <= held
    assert len(held) == 3 + 1 + 1  # all params, one shard each of grads and optimizer states
    assert (data.numel, data.padded_numel, layout.padding) == (26, 27, 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_held_are_the_papers_formula_plus_padding(stage):
    data = S.model_states(3, k=12)
    padded = model_state_bytes(data.padded_numel, 3, stage, 12)["total"]
    assert data.held_bytes[stage] == [padded] * 3
    assert data.formula_bytes[stage] == model_state_bytes(26, 3, stage, 12)


def test_partitioned_categories_follow_the_stages():
    assert [S.partitioned(s) for s in range(4)] == [
        {"params": False, "grads": False, "optimizer_states": False},
        {"params": False, "grads": False, "optimizer_states": True},
        {"params": False, "grads": True, "optimizer_states": True},
        {"params": True, "grads": True, "optimizer_states": True}]


@pytest.mark.parametrize("nd", [2, 3, 4, 5])
def test_the_ring_has_2_nd_minus_1_steps_and_ends_with_the_sum_everywhere(nd):
    start, steps = S.ring_all_reduce(nd=nd)
    assert len(steps) == 2 * (nd - 1)
    total = [sum(start[r][c] for r in range(nd)) for c in range(nd)]
    assert all(row == total for row in steps[-1].after)
    assert [s.phase for s in steps] == ["reduce-scatter"] * (nd - 1) + ["all-gather"] * (nd - 1)
    # after the reduce-scatter phase, rank r holds the whole sum of chunk r + 1; each rank sends one chunk a step
    assert all(steps[nd - 2].after[r][(r + 1) % nd] == total[(r + 1) % nd] for r in range(nd))
    assert all(len(s.sends) == nd and len({c for c, _ in s.sends}) == nd for s in steps)


def test_the_five_collectives_compute_what_comm_defines():
    v = S.collectives.start_values(3)
    total = [sum(v[r][c] for r in range(3)) for c in range(3)]
    assert S.collective("all_reduce").after == [total] * 3
    assert S.collective("reduce_scatter").after == [[total[c] if c == r else None for c in range(3)]
                                                    for r in range(3)]
    assert S.collective("all_gather").after == [[v[c][c] for c in range(3)]] * 3
    assert S.collective("broadcast", root=1).after == [v[1]] * 3
    assert S.collective("reduce").after[0] == total and S.collective("reduce").after[1] == v[1]
    with pytest.raises(ConfigError, match="op 'gather'"):
        S.collective("gather")


def test_zero1_frames_end_with_one_sgd_step_on_the_mean_gradient():
    layouts, frames = S.zero1_frames(lr=0.5)
    assert [f.phase for f in frames] == ["start", "reduce-scatter", "update", "all-gather"]
    assert layouts[1].shard_range == (3, 6) and layouts[0].padding == 2
    p = torch.nn.Parameter(torch.tensor(S.zero1_step.DEFAULT_PARAMS, dtype=torch.float64))
    p.grad = torch.tensor(S.zero1_step.DEFAULT_GRADS, dtype=torch.float64).mean(0)
    torch.optim.SGD([p], lr=0.5).step()
    for r in range(3):
        assert frames[-1].params[r][:7] == pytest.approx(p.detach().tolist(), abs=1e-12)
        a, b = layouts[r].shard_range
        # ZeRO-1 keeps the whole gradient: shard r holds the mean, the rest rank r's own gradient.
        mean = torch.tensor(S.zero1_step.DEFAULT_GRADS, dtype=torch.float64).mean(0).tolist() + [0.0, 0.0]
        own = S.zero1_step.DEFAULT_GRADS[r] + [0.0, 0.0]
        assert frames[1].reduced[r] == [a <= i < b for i in range(9)]
        assert frames[1].grads[r] == pytest.approx([mean[i] if a <= i < b else own[i] for i in range(9)], abs=1e-12)


def _recorded_gathers(model, inputs):
    """A second, independent run: every all_gather a Zero3Engine issues, as (phase, unit of its output)."""
    from zerolearn.engines import Zero3Engine

    calls, real = [], comm.all_gather

    def spy(output, input, *args, **kwargs):
        calls.append((comm.guard.calling_unit()[1].split(":")[0], output.untyped_storage()._cdata))
        return real(output, input, *args, **kwargs)

    with z3.one_rank_world():
        engine = Zero3Engine(model, optimizer="sgd", lr=0.01, prefetch_mb=0)
        names = {b.full.untyped_storage()._cdata: u.name for u in engine.units for b in u.buckets}
        comm.all_gather = spy
        try:
            for _ in range(2):
                calls.clear()
                engine.backward(engine(inputs).float().pow(2).mean())
                engine.step()
                engine.zero_grad()
        finally:
            comm.all_gather = real
    return [(phase, names[key]) for phase, key in calls]


def test_zero3_schedule_order_is_the_recorded_gathers_of_a_real_run():
    from zerolearn.models import MLP

    torch.manual_seed(0)
    model, x = MLP(width=8, num_layers=4), torch.randn(4, 8)
    twin = MLP(width=8, num_layers=4)
    twin.load_state_dict(model.state_dict())
    sched = S.zero3_schedule(model, x)
    drawn = [(e.phase, e.unit) for e in sched.events if e.kind in ("gather", "prefetch")]
    assert drawn == sched.gathers == _recorded_gathers(twin, x)
    assert len(drawn) == sched.ledger_gathers == 2 * len(sched.units)  # forward and backward, one unit a time
    assert [u for p, u in drawn if p == "forward"] == sched.units  # each unit's gather, then the next one's prefetch
    first = [(e.kind, e.unit) for e in sched.events[:2]]
    assert first == [("gather", sched.units[0]), ("prefetch", sched.units[1])]  # never a prefetch before a gather
    computes = [(e.phase, e.unit) for e in sched.events if e.kind == "compute"]
    assert computes == [("forward", u) for u in sched.units] + [("backward", u) for u in reversed(sched.units)]
    # the sawtooth: never more than the unit computing and one prefetch alive, nothing after the step
    assert max(e.alive_bytes for e in sched.events) == 2 * max(sched.unit_bytes.values())
    assert sched.events[-1].alive_bytes == 0
    assert not torch.distributed.is_initialized()


def test_bucket_schedule_matches_the_recorded_run_and_its_buckets():
    s = S.bucket_schedule(stage=2)
    assert s.op == "reduce_scatter" and len(s.buckets) == len(s.measured) == len(s.ideal) == 12
    assert s.buckets[0][0] == "head.proj.weight"  # the last layer's gradients come first
    for (c0, c1, m0, m1), nxt in zip(s.ideal, s.ideal[1:] + [None], strict=True):
        assert c0 <= c1 <= m0 <= m1  # a bucket is reduced only once complete
        if nxt:
            assert nxt[0] == pytest.approx(c1) and nxt[2] >= m1 - 1e-12  # one link, in launch order
    assert s.ideal[-1][1] == pytest.approx(s.compute_s)
    with pytest.raises(ConfigError, match="stage 3"):
        S.bucket_schedule(stage=3)


def test_megatron_blocks_and_pa_chunks_come_from_the_residual_modules():
    split = S.tensor_split(6, 4, 2)
    assert split.column == [(0, 3), (3, 6)] and split.row == [(0, 2), (2, 4)]
    assert split.functions["_CopyToParallel"].startswith("Forward: identity. Backward: sum")
    assert split.functions["_ReduceFromParallel"].startswith("Forward: sum")
    ck = S.checkpoint_chunks(1, 4, 5, 3)
    assert (ck.numel, ck.padded, ck.chunks) == (20, 21, [(0, 7), (7, 14), (14, 21)])
    with pytest.raises(ConfigError, match="nm 3"):
        S.tensor_split(6, 4, 3)


def test_offload_placement_is_the_papers_and_zeropp_paths_follow_the_nodes():
    placed = S.offload_placement(1e9, 8, 3, "disk")
    ref = offload_state_bytes(1e9, 8, 3, "disk")
    assert all(placed[loc][c] == ref[loc][c] for loc in ref for c in ref[loc])
    paths = S.zeropp_paths(4096, 4, 2)
    assert all(m.link == "intra" for m in paths["hpZ"])  # hpZ never leaves the node
    assert {(m.src, m.dst) for m in paths["qgZ"] if m.hop == 2} == {(0, 2), (2, 0), (1, 3), (3, 1)}
    assert len(paths["qwZ"]) == 4 * 3
    with pytest.raises(ConfigError, match="node_ranks=3"):
        S.zeropp_paths(4096, 4, 3)


def test_bad_input_names_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError, match="nd 9: allowed are 1 to 8"):
        S.model_states(9)
    with pytest.raises(ConfigError, match="stage 5: allowed are 0, 1, 2, 3"):
        S.partitioned(5)
    with pytest.raises(ConfigError, match="one gradient per rank"):
        S.zero1_frames(nd=2)
    with pytest.raises(ConfigError, match="n_frames 0"):
        step_through(lambda fig, i: None, 0)


def test_every_drawing_returns_a_figure():
    sched = S.zero3_schedule()
    figs = [S.model_states_figure(3), S.offload_figure(), S.collectives_figure(3), S.ring_figure(3),
            S.zero1_figure(), S.bucket_schedule_figure(stage=0), S.zero3_figure(sched), S.megatron_figure(),
            S.zeropp_figure()]
    assert all(isinstance(f, Figure) and f.axes for f in figs)


def test_animations_are_small_deterministic_and_step_in_a_widget():
    ring = S.ring_animation(3)
    html = ring.html
    assert html == S.ring_animation(3).html  # the same bytes twice: no uuid, no timestamp
    # The frames, and the first once more as the player's image: what shows where scripts do not run.
    assert html.count("data:image/png;base64") == ring.n_frames + 1 == 6 and len(html) < 400_000
    assert "_anim_img" in html and "once" in html
    box = S.zero1_animation().widget()
    play, slider = box.children[0].children
    slider.value = 2
    assert box.children[1].value == S.zero1_step._WHAT["update"] and play.max == 3
    anim = S.zero3_animation(S.zero3_schedule(), frames=3)
    assert anim.n_frames == 3 and dataclasses.is_dataclass(anim)
