"""The step timeline: intervals read from the profiler hold each stage's collectives,
as many as the ledger counts; the overlap of communication with compute is computed
exactly; the stored results draw.

Expected overlaps are worked out by hand in the comments from the constructed intervals.
"""

import io
import json
import os

import pytest
from matplotlib.figure import Figure

from zerolearn import comm, timeline
from zerolearn.config import TrainConfig
from zerolearn.errors import ConfigError
from zerolearn.figures import timeline as figs
from zerolearn.timeline import Spec, intersect, intervals_from_events, length, overlap, subtract, union
from zerolearn.timeline.__main__ import main
from zerolearn.timeline.intervals import PHASE, STEP

pytestmark = pytest.mark.slow  # profiled steps at every stage

STORED = os.path.join(os.path.dirname(__file__), "..", "notebooks", "data", "timeline")
EXPECTED_OPS = {0: {"all_reduce"}, 1: {"reduce_scatter", "all_gather"}, 2: {"reduce_scatter", "all_gather"},
                3: {"reduce_scatter", "all_gather"}}


def iv(rank, lane, label, start, end, **extra):
    return {"rank": rank, "lane": lane, "label": label, "start": start, "end": end, **extra}


# ----- interval arithmetic and the overlap, by hand ---------------------------------------
def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert length([(0, 2), (1, 3), (5, 6)]) == 4
    assert intersect([(0, 4), (6, 8)], [(3, 7)]) == [(3, 4), (6, 7)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert subtract([(0, 1)], []) == [(0, 1)]


def constructed_step() -> list[dict]:
    """Rank 0: forward [0, 4], backward [4, 11], step [11, 12] (seconds).
    all_reduce A [5, 8] launched in backward (launch [5, 5.5]), never waited for;
    all_reduce B [9, 11] launched in backward (launch [9, 9.25]), waited for [10, 11];
    a synchronous all_gather S [11.5, 11.8] in the step (the main thread blocked throughout).
    Rank 1: forward [0, 4]; all_gather [0, 2] launched in forward (launch [0, 0.5])."""
    return [iv(0, "step", "step", 0, 12), iv(0, "compute", "forward", 0, 4), iv(0, "compute", "backward", 4, 11),
            iv(0, "compute", "step", 11, 12),
            iv(0, "comm", "all_reduce", 5, 8, phase="backward"),
            iv(0, "launch", "all_reduce", 5, 5.5, phase="backward"),
            iv(0, "comm", "all_reduce", 9, 11, phase="backward"),
            iv(0, "launch", "all_reduce", 9, 9.25, phase="backward"),
            iv(0, "wait", "all_reduce", 10, 11, phase="backward"),
            iv(0, "comm", "all_gather", 11.5, 11.8, phase="step", sync=True),
            iv(0, "wait", "all_gather", 11.5, 11.8, phase="step"),
            iv(1, "step", "step", 0, 4), iv(1, "compute", "forward", 0, 4),
            iv(1, "comm", "all_gather", 0, 2, phase="forward"), iv(1, "launch", "all_gather", 0, 0.5, phase="forward")]


def test_overlap_is_the_communication_time_hidden_behind_compute():
    steps = constructed_step()
    # Compute K = [0, 12] minus launches and waits [5, 5.5], [9, 9.25], [10, 11], [11.5, 11.8].
    # C = [5, 8] + [9, 11] + [11.5, 11.8]: 5.3 s. C and K: [5.5, 8] + [9.25, 10] = 3.25 s.
    whole = overlap(steps, 0)
    assert whole["comm_s"] == pytest.approx(5.3)
    assert whole["hidden_s"] == pytest.approx(3.25)
    assert whole["exposed_s"] == pytest.approx(2.05)
    assert whole["overlap"] == pytest.approx(3.25 / 5.3)
    assert whole["wait_s"] == pytest.approx(1.3)
    assert whole["compute_s"] == pytest.approx(12 - 0.5 - 0.25 - 1 - 0.3)
    assert whole["calls"] == 3
    # Backward alone: C = [5, 8] + [9, 11] = 5 s, of which 3.25 s hidden: 65 %.
    backward = overlap(steps, 0, phase="backward")
    assert backward["overlap"] == pytest.approx(0.65)
    assert (backward["wait_s"], backward["calls"]) == (pytest.approx(1.0), 2)
    # The step's synchronous all_gather hides nothing: the main thread was blocked in it.
    assert overlap(steps, 0, phase="step")["overlap"] == 0.0
    assert overlap(steps, 0, phase="step")["wait_s"] == pytest.approx(0.3)
    # Only the all_reduces, over the whole step: the same 3.25 of 5 s.
    assert overlap(steps, 0, ops=("all_reduce",))["overlap"] == pytest.approx(0.65)
    # Nothing communicated in forward: 0, not a division by zero.
    assert overlap(steps, 0, phase="forward") == {"comm_s": 0, "hidden_s": 0, "exposed_s": 0, "overlap": 0.0,
                                                 "wait_s": 0, "release_s": 0, "compute_s": 4, "calls": 0}
    # Rank 1: C = [0, 2], K = [0.5, 4]: 1.5 of 2 s hidden.
    assert overlap(steps, 1)["overlap"] == pytest.approx(0.75)
    assert timeline.calls(steps, 0) == {"all_reduce": 2, "reduce_scatter": 0, "all_gather": 1, "broadcast": 0}


def test_intervals_from_profiler_events():
    # A barrier before the step is left out; times become seconds from the step's start.
    launch, wait = comm.LAUNCH, comm.WAIT
    events = [("gloo:barrier", 9, 0.0, 50.0), (STEP, 1, 100.0, 1100.0),
              (f"{PHASE}|forward", 1, 100.0, 300.0), (f"{PHASE}|backward", 1, 300.0, 900.0),
              (f"{PHASE}|step", 1, 900.0, 1100.0),
              (f"{launch}|reduce_scatter|async|bucket[a..b]|backward: reduce", 1, 400.0, 410.0),
              ("gloo:all_reduce", 7, 405.0, 700.0),
              (f"{wait}|reduce_scatter", 1, 650.0, 720.0),
              (f"{comm.RELEASE}|reduce_scatter", 1, 700.0, 715.0),  # gloo let go 15 us after it finished
              (f"{launch}|all_gather|sync|bucket[a..b]|step: publish", 1, 950.0, 1000.0),
              ("gloo:all_gather", 8, 955.0, 990.0)]
    out = intervals_from_events(events, rank=3)
    by_lane = {}
    for i in out:
        assert i["rank"] == 3
        by_lane.setdefault(i["lane"], []).append(i)
    assert by_lane["step"] == [iv(3, "step", "step", 0.0, 0.001)]
    assert [(i["label"], i["start"], i["end"]) for i in by_lane["compute"]] == [
        ("forward", 0.0, 0.0002), ("backward", 0.0002, 0.0008), ("step", 0.0008, 0.001)]
    rs, ag = by_lane["comm"]
    assert (rs["label"], rs["start"], rs["end"], rs["phase"], rs["sync"], rs["backend"]) == (
        "reduce_scatter", 0.0003, 0.0006, "backward", False, "gloo:all_reduce")
    assert (rs["unit"], rs["doing"]) == ("bucket[a..b]", "backward: reduce")
    # A synchronous call ends when it returns; its whole call is a wait.
    assert (ag["start"], ag["end"], ag["sync"], ag["phase"]) == (0.00085, 0.0009, True, "step")
    assert [(i["label"], i["start"], i["end"]) for i in by_lane["launch"]] == [("reduce_scatter", 0.0003, 0.00031)]
    assert sorted((i["label"], i["start"], i["end"], i["release"]) for i in by_lane["wait"]) == [
        ("all_gather", 0.00085, 0.0009, 0.0), ("reduce_scatter", 0.00055, 0.00062, 0.000015)]
    with pytest.raises(ValueError, match="2 collectives launched but the profiler recorded 1 "):
        intervals_from_events([e for e in events if e[0] != "gloo:all_gather"], rank=0)
    with pytest.raises(ValueError, match="one 'zerolearn.step' event"):
        intervals_from_events(events[2:], rank=0)


def test_profiler_labels_cost_nothing_without_a_profiler():
    import contextlib

    import torch

    assert isinstance(comm.profiler_label(comm.LAUNCH, "all_reduce"), contextlib.nullcontext)
    with torch.profiler.profile() as prof:
        with comm.profiler_label(comm.WAIT, "all_gather"):
            pass
    assert f"{comm.WAIT}|all_gather" in [e.name for e in prof.events()]


def test_spec_and_cli_refuse_what_cannot_be_recorded(tmp_path):
    with pytest.raises(ConfigError, match="only ZeRO-3 prefetches"):
        Spec("x", TrainConfig(stage=2), prefetch=False)
    with pytest.raises(ConfigError, match="grad-accum-steps"):
        Spec("x", TrainConfig(stage=3, grad_accum_steps=2, global_batch_size=4))
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), "--world-size", "0"])
    assert e.value.code == 2


# ----- the stored results: counts and labels, and the figures ---------------------------
def stored(name: str) -> dict:
    with open(os.path.join(STORED, name)) as f:
        return json.load(f)


def check_step(intervals: list[dict], ledger: list[dict], stage: int, buckets: int) -> None:
    """The collectives a stage runs, as many as the ledger counts; intervals inside the step."""
    for rank, counted in enumerate(ledger):
        calls = timeline.calls(intervals, rank)
        assert calls == {op: c["calls"] for op, c in counted.items()}, f"rank {rank}"
        assert {op for op, n in calls.items() if n} == EXPECTED_OPS[stage]
        mine = [i for i in intervals if i["rank"] == rank]
        step = next(i for i in mine if i["lane"] == "step")
        assert step["start"] == 0.0
        for i in mine:
            assert 0.0 <= i["start"] <= i["end"] <= step["end"], i
        comms = [i for i in mine if i["lane"] == "comm"]
        if stage == 0:
            assert calls["all_reduce"] == buckets
            assert {i["phase"] for i in comms} == {"backward"}
        elif stage in (1, 2):  # reduce-scatter of each bucket in backward, all-gather of each in the step
            assert calls["reduce_scatter"] == calls["all_gather"] == buckets
            assert {i["phase"] for i in comms if i["label"] == "reduce_scatter"} == {"backward"}
            assert {i["phase"] for i in comms if i["label"] == "all_gather"} == {"step"}
        else:  # every group gathered before its forward and again before its backward (Sec 5.3)
            assert calls["all_gather"] == 2 * calls["reduce_scatter"] == 2 * buckets
            gathers = [i for i in comms if i["label"] == "all_gather"]
            assert sum(i["phase"] == "forward" for i in gathers) == sum(i["phase"] == "backward" for i in gathers)
            assert {i["doing"] for i in gathers} == {"forward: gather", "backward: gather"}
            assert {i["phase"] for i in comms if i["label"] == "reduce_scatter"} == {"backward"}


def test_stored_results_hold_each_stages_collectives():
    stages = stored(timeline.FILES["stages"])
    assert [s["stage"] for s in stages["stages"]] == [0, 1, 2, 3]
    for s in stages["stages"]:
        check_step(s["intervals"], s["ledger"], s["stage"], s["buckets"])
    sweep = stored(timeline.FILES["sweep"])
    buckets = [row["buckets"] for row in sweep["rows"]]
    assert buckets == sorted(buckets, reverse=True)  # larger buckets, fewer of them
    for row in sweep["rows"]:
        assert row["calls"]["reduce_scatter"] == row["calls"]["all_gather"] == row["buckets"]
        assert 0.0 <= row["backward_overlap"] <= 1.0
    prefetch = stored(timeline.FILES["prefetch"])
    assert [r["prefetch"] for r in prefetch["runs"]] == [True, False]
    for run in prefetch["runs"]:
        check_step(run["intervals"], run["ledger"], 3, run["buckets"])


def test_figures_draw_the_stored_results():
    drawn = [figs.stage_timelines_figure(stored(timeline.FILES["stages"])),
             figs.bucket_sweep_figure(stored(timeline.FILES["sweep"])),
             figs.sweep_timelines_figure(stored(timeline.FILES["sweep"])),
             figs.prefetch_figure(stored(timeline.FILES["prefetch"])),
             figs.lanes_figure([("constructed", constructed_step())])]
    for fig in drawn:
        assert isinstance(fig, Figure) and fig.axes
        fig.savefig(io.BytesIO(), format="png", dpi=40)
    labels = [t.get_text() for t in drawn[0].axes[0].get_yticklabels()]
    assert labels[:3] == ["rank 0 compute", "rank 0 comm", "rank 0 wait"]


# ----- real ranks ---------------------------------------------------------------------
SMALL = TrainConfig(model="gpt", d_model=32, n_head=2, seq_len=16, n_layer=2, global_batch_size=4, bucket_mb=0.05)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    traces = str(tmp_path_factory.mktemp("traces"))
    specs = [*timeline.stage_specs(SMALL), Spec("noprefetch", SMALL.replace(stage=3), prefetch=False)]
    return timeline.record(specs, 2, traces), traces


@pytest.mark.slow
def test_recorded_steps_hold_each_stages_collectives_as_the_ledger_counts(recorded):
    records, _ = recorded
    assert [rec["stage"] for rec in records] == [0, 1, 2, 3, 3]  # stage_specs, then stage 3 without prefetch
    for rec in records:
        (step,) = rec["steps"]
        check_step(step["intervals"], step["ledger"], rec["stage"], rec["buckets"])
        for row in step["summary"]:
            assert 0.0 <= row["overlap"] <= 1.0 and row["step_s"] > 0


@pytest.mark.slow
def test_without_prefetch_each_forward_gather_is_waited_for_before_the_next(recorded):
    records, _ = recorded
    off = records[-1]["steps"][0]["intervals"]
    for rank in (0, 1):
        # Without prefetch a unit's hook gathers only that unit (its label): the next unit's
        # gathers start after this unit's have all finished.
        gathers = [i for i in off if i["rank"] == rank and i["lane"] == "comm" and i["phase"] == "forward"]
        units = list(dict.fromkeys(i["unit"] for i in gathers))
        assert len(units) == 4  # embed, blocks.0, blocks.1, head
        for a, b in zip(units, units[1:], strict=False):  # each unit with the next
            assert max(i["end"] for i in gathers if i["unit"] == a) <= min(i["start"] for i in gathers
                                                                           if i["unit"] == b)


@pytest.mark.slow
def test_trace_files_are_chrome_traces_with_the_collectives_labelled(recorded):
    _, traces = recorded
    names = sorted(os.listdir(traces))
    assert names == sorted(f"{n}_rank{r}.json" for n in ("stage0", "stage1", "stage2", "stage3", "noprefetch")
                           for r in (0, 1))
    with open(os.path.join(traces, "stage2_rank1.json")) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    assert complete and all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in complete)
    labels = {e["name"].split("|")[0] + "|" + e["name"].split("|")[1] for e in complete if "|" in e["name"]}
    assert {f"{comm.LAUNCH}|reduce_scatter", f"{comm.LAUNCH}|all_gather", f"{PHASE}|backward"} <= labels
    assert any(e["name"] == "gloo:all_gather" for e in complete)
