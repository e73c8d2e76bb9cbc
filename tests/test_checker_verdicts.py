"""The checker's verdict when a mistake lives on one rank, its choice among the ranks'
verdicts, the line it names, valid solutions its memory rule accepts, and the CLI's
answer to bad input. Rank checks share one persistent pool of 2 ranks."""

import contextlib
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from zerolearn import comm, exercises
from zerolearn.exercises import check, core
from zerolearn.exercises.__main__ import main
from zerolearn.exercises.timing import OnOneRank

pytestmark = pytest.mark.slow  # the checker's verdicts on spawned ranks


@pytest.fixture(scope="module", autouse=True)
def persistent_ranks():
    with exercises.reusing_ranks():
        yield


def test_a_bug_on_the_last_rank_only_is_named_with_that_ranks_own_words():
    exercise = exercises.EXERCISES["01.average_gradients"]
    fn = OnOneRank(exercise.solution, exercise.bugs["no_divide"].fn, -1)
    result = check("01.average_gradients", fn, quiet=True)
    assert not result.passed and result.world_size == 2
    assert result.mistake.rank == 1 and result.mistake.step == 0
    assert "not their mean" in result.mistake.message, str(result)


def test_a_function_that_raises_on_one_rank_shows_its_exception():
    exercise = exercises.EXERCISES["03.accumulate"]
    result = check("03.accumulate", OnOneRank(exercise.solution, None, -1), quiet=True)
    assert not result.passed and (result.mistake.rank, result.mistake.step) == (1, 0)
    assert "RaisedOnOneRank: a mistake on rank 1 of 2 only" in str(result), str(result)
    # the ranks that waited for it were replaced: the next check runs on fresh ones
    assert check("03.accumulate", solution=True, quiet=True).passed


def test_the_real_verdict_comes_before_what_a_peers_stop_caused():
    outcomes = {0: ("wrong", (2, "your function raised RuntimeError: Connection reset by peer"), 1.0),
                1: ("wrong", (2, "the gradient shard, element 3: you have 1"), 2.0),
                2: ("stopped", 1, 1.5)}
    result = core._verdict("x", outcomes, 3)
    assert (result.mistake.rank, result.mistake.step) == (1, 2)
    earlier = {**outcomes, 2: ("wrong", (1, "its own words"), 3.0)}
    assert core._verdict("x", earlier, 3).mistake.rank == 2  # an earlier step comes first
    died = core._verdict("x", {0: outcomes[0]}, 2, died={1: "process exited with code -6\n"})
    assert died.mistake.rank == 1 and "code -6" in died.mistake.message


def test_the_readers_line_skips_the_standard_librarys_and_torchs_frames():
    frames = traceback.StackSummary.from_list([
        traceback.FrameSummary("/home/reader/zero.py", 12, "zero1_step", line="adam.step()"),
        traceback.FrameSummary(torch.optim.__file__, 40, "step", line="raise ValueError"),
        traceback.FrameSummary(contextlib.__file__, 158, "__exit__", line="self.gen.throw(value)"),
    ])
    assert core._reader_frames(frames) == " (line 12: adam.step())"


def test_constant_buffer_accepts_a_scratch_tensor_of_the_buffers_size():
    def constant_buffer(tensors, buffer, world_size):
        scratch = torch.empty(buffer.numel())  # 4 KiB, alive for the whole call; does not grow with the model
        flats = [t.view(-1) for t in tensors]
        n, size = sum(f.numel() for f in flats), buffer.numel()
        for lo in range(0, n, size):
            hi, offset = min(lo + size, n), 0
            for f in flats:
                a, b = max(lo, offset), min(hi, offset + f.numel())
                if a < b:
                    buffer[a - lo:b - lo].copy_(f[a - offset:b - offset])
                offset += f.numel()
            dist.all_reduce(buffer[:hi - lo])
            torch.div(buffer[:hi - lo], world_size, out=scratch[:hi - lo])
            offset = 0
            for f in flats:
                a, b = max(lo, offset), min(hi, offset + f.numel())
                if a < b:
                    f[a - offset:b - offset].copy_(scratch[a - lo:b - lo])
                offset += f.numel()

    result = check("05.constant_buffer", constant_buffer, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("argv,named", [
    (["check", "02.no_such", "--solution"], "'02.no_such'"),
    (["check", "--all"], "--solution"),
    (["check", "02.zero1_step", "--bug", "nope"], "'nope'"),
    (["times", "00.max_batch"], "'00.max_batch'"),
    (["check", "--all", "--solution", "--fast"], "--fast"),
    (["frobnicate"], "'frobnicate'"),
])
def test_cli_answers_bad_input_with_one_line_and_exit_2(argv, named, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and named in err, err


def test_cli_bad_input_from_the_shell_exits_2():
    run = subprocess.run([sys.executable, "-m", "zerolearn.exercises", "check", "--all", "--solution", "--fast"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "--fast" in run.stderr


def test_launch_reports_the_cause_before_a_peers_closed_connection():
    import time

    from zerolearn import dist as zdist
    from zerolearn.dist import RankError, launch

    def fails():
        if zdist.context().rank == 1:
            raise RuntimeError("[gloo] Connection reset by peer")  # what a peer of a stopped rank reads
        time.sleep(0.5)
        raise ValueError("the cause")

    with pytest.raises(RankError, match="rank 0 failed: ValueError: the cause"):
        launch(fails, 2, timeout_s=60)


def test_quantized_all_gather_accepts_another_way_to_divide():
    # x * (127 / absmax) rounds a few elements differently from x / (absmax / 127): still within half a step.
    def quantized_all_gather(out, shard, block, world_size):
        n = shard.numel()
        nb = -(-n // block)
        x = torch.nn.functional.pad(shard, (0, nb * block - n)).view(nb, block)
        absmax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        q = torch.round(x * (127 / absmax)).to(torch.int8)
        all_q = torch.empty(world_size * nb * block, dtype=torch.int8)
        all_scales = torch.empty(world_size * nb)
        dist.all_gather_single(all_q, q.flatten())
        dist.all_gather_single(all_scales, (absmax / 127).flatten())
        values = all_q.view(world_size, nb, block).float() * all_scales.view(world_size, nb, 1)
        out.copy_(values.view(world_size, -1)[:, :n].flatten())

    result = check("08.quantized_all_gather", quantized_all_gather, quiet=True)
    assert result.passed, str(result)


def test_dpu_step_accepts_a_lambda_on_the_worker_and_its_own_warm_up_test():
    def dpu_step(step, params, master, grad, host_step, pending, worker):
        if pending is None and step < 1:  # the warm-up, written another way
            host_step(grad)
        else:
            if pending is not None:
                pending.result()
            params.copy_(master)
            return worker.submit(lambda: host_step(grad))
        params.copy_(master)
        return None

    result = check("08.dpu_step", dpu_step, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("wait", ["asks_done", "polls_done"])
def test_dpu_step_accepts_a_future_asked_done_as_concurrent_futures_promises(wait):
    import time

    def dpu_step(step, params, master, grad, host_step, pending, worker):
        if step == 0:
            host_step(grad)
            params.copy_(master)
            return None
        if wait == "asks_done" and pending is not None and not pending.done():
            pending.result()
        while wait == "polls_done" and pending is not None and not pending.done():
            time.sleep(0.005)
        params.copy_(master)
        return worker.submit(host_step, grad)

    result = check("08.dpu_step", dpu_step, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("call", ["dist.all_gather_single", "comm.all_gather"])
def test_an_error_inside_a_collective_is_named_at_the_readers_line(call):
    import inspect
    import math

    import torch.nn.functional as F

    def partition_checkpoint(x, group):
        nm, rank = dist.get_world_size(group), dist.get_rank(group)
        shape, numel, c = x.shape, x.numel(), math.ceil(x.numel() / nm)
        piece = F.pad(x.detach().reshape(-1), (0, c * nm - numel))[rank * c:(rank + 1) * c].clone()

        def restore():
            full = torch.empty(c * nm + 1)  # one element too many: gloo refuses the all-gather
            if call == "comm.all_gather":
                comm.all_gather(full, piece, group=group)
            else:
                dist.all_gather_single(full, piece, group=group)
            return full[:numel].view(shape)

        return restore

    lines, first = inspect.getsourcelines(partition_checkpoint)
    at = first + next(i for i, line in enumerate(lines) if line.strip().startswith(f"{call}(full"))
    result = check("05.partition_checkpoint", partition_checkpoint, quiet=True)
    assert not result.passed
    assert f"(line {at}: {call}(full, piece, group=group))" in str(result), str(result)


def test_a_trials_machinery_is_skipped_when_naming_the_readers_line():
    def wrapper():  # what a trial puts around a collective
        return None

    frames = traceback.StackSummary.from_list([
        traceback.FrameSummary("/home/reader/zero.py", 7, "restore", line="comm.all_gather(full, piece)"),
        traceback.FrameSummary(wrapper.__code__.co_filename, wrapper.__code__.co_firstlineno + 1, "wrapper",
                               line="return None"),
    ])
    assert core._reader_frames(frames) == f" (line {wrapper.__code__.co_firstlineno + 1}: return None)"
    core.machinery(wrapper)
    assert core._reader_frames(frames) == " (line 7: comm.all_gather(full, piece))"


def _freed_read(op):
    t = torch.zeros(3, 4)
    t.untyped_storage().resize_(0)
    try:
        if op == "linear":
            torch.nn.functional.linear(t, torch.ones(2, 4))
        else:
            torch.zeros(12).set_(t.untyped_storage(), 0, (12,))
    except RuntimeError as e:
        return e
    raise AssertionError(f"{op} read a freed storage without an error")


@pytest.mark.parametrize("op", ["linear", "set"])
def test_torchs_words_for_a_freed_storage_are_said_in_the_books(op):
    message = core._raised(_freed_read(op))
    assert "storage held 0 bytes, freed (untyped_storage().resize_(0)) or never allocated" in message, message
    assert "Caffe2" not in message and "torch.compile" not in message
    assert "(line " in message and "RuntimeError" in message


def test_a_line_a_rank_could_not_read_is_filled_in_from_the_readers_source():
    import inspect

    def reader():
        def inner():
            return 1 / 0

        return inner

    inner_line = inspect.getsourcelines(reader)[1] + 2
    message = f"your function raised ZeroDivisionError: division by zero (line {inner_line} of inner)"
    assert core._sourced(message, reader).endswith(f"(line {inner_line}: return 1 / 0)")
    assert core._sourced(" (line 3 of elsewhere)", reader) == " (line 3 of elsewhere)"  # not the reader's: kept


def _cell(name: str, edits: dict[str, str]):
    """The reference solution of ``name`` with each ``old: new`` edit made once, defined as a cell."""
    source = exercises.solution_source(name)
    for old, new in edits.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"__name__": "__main__"}
    exec(compile(exercises.PRELUDE + "\n" + source, "<cell>", "exec"), namespace)  # noqa: S102
    return namespace[exercises.EXERCISES[name].solution.__name__]


GATHER = "04.gather_hooks"


@pytest.mark.parametrize("edits, words", [
    ({"resize_(flat.numel() * flat.element_size())": "resize_(flat.numel())"},
     ["a tensor needs 8,320 bytes of its storage and the storage holds 4,160",
      "untyped_storage().resize_(n) takes n in bytes, numel() * element_size()", "(numel() alone counts elements)"]),
    ({"        dist.all_gather_single(flat, shard)\n": "        dist.all_gather_single(flat, shard.bfloat16())\n"},
     ["the all-gather's output and input must have one dtype: the input is bfloat16, the output float32"]),
    ({"        dist.all_gather_single(flat, shard)\n": "        dist.all_gather_single(flat, shard[:-1])\n"},
     ["the all-gather's output must hold world_size x the input's elements", "every rank's shard has the same size"]),
], ids=["elements_for_bytes", "dtype", "size"])
def test_gloo_and_torch_raw_errors_are_answered_with_their_cause(edits, words):
    result = check(GATHER, _cell(GATHER, edits), quiet=True)
    assert not result.passed and result.written, str(result)
    for said in words:
        assert said in str(result), str(result)
    for raw in ("ProcessGroupGloo", "TensorOptions", "setStorage"):
        assert raw not in str(result), str(result)


def test_a_reduce_scatter_that_does_not_fit_is_answered_with_its_cause():
    said = core._translated("[rank0]:[F1206 ProcessGroupGloo.cpp:1537] Check failed: outputShape[0] * worldSize "
                            "== inputShape[0] (3 vs. 4).")
    assert said.startswith("the reduce-scatter's input must hold world_size x the output's elements"), said
    said = core._translated("Check failed: outputTensors[i].dtype() == inputTensors[i].dtype() "
                            "(c10::BFloat16 vs. float).")
    assert "the output is bfloat16, the input float32" in said, said
    assert core._translated("some other words") is None


def test_a_name_rebound_inside_a_hook_is_answered_with_the_cause():
    """``shard = out / world_size`` inside a hook makes shard a local name of the hook: Python's
    UnboundLocalError, answered with why and the in-place fix."""
    fn = _cell("03.reduce_scatter_hook", {"        shard.div_(world_size)\n": "        shard = shard / world_size\n"})
    result = check("03.reduce_scatter_hook", fn, quiet=True)
    assert not result.passed and result.written, str(result)
    assert "UnboundLocalError" in str(result)
    assert "makes shard a new local name there" in str(result) and "shard.copy_(...)" in str(result), str(result)


def test_an_async_output_used_before_its_wait_is_named_with_both_lines():
    fn = _cell("01.bucket_hook", {"            handle.wait()\n            buffer.div_(world_size)\n":
                                  "            buffer.div_(world_size)\n            handle.wait()\n"})
    result = check("01.bucket_hook", fn, quiet=True)
    assert not result.passed and result.written, str(result)
    text = str(result)
    assert "the output of dist.all_reduce(..., async_op=True)" in text and "before its handle's .wait()" in text
    assert "was used by torch's div_" in text and "The use" in text, text


def test_an_async_gather_left_in_flight_when_the_step_returns_is_named():
    fn = _cell("02.zero1_step", {"dist.all_gather_single(flat_params, working)  # every rank's updated shard":
                                 "handle = dist.all_gather_single(flat_params, working, async_op=True)  #"})
    result = check("02.zero1_step", fn, quiet=True)
    assert not result.passed and result.written, str(result)
    assert "the output of dist.all_gather_single(..., async_op=True)" in str(result)
    assert "Your function returned with it still in flight" in str(result), str(result)


def test_a_name_rebound_instead_of_written_is_named():
    fn = _cell("02.zero1_step", {"dist.all_gather_single(flat_params, working)  # every rank's updated shard":
                                 "full = torch.empty_like(flat_params)\n        dist.all_gather_single(full, working)\n"
                                 "        flat_params = full  #"})
    result = check("02.zero1_step", fn, quiet=True)
    assert not result.passed and result.written, str(result)
    assert "flat_params after your step is exactly as it was before your function ran" in str(result)
    assert "`flat_params = ...` inside your function binds the name to a new tensor" in str(result), str(result)


def test_the_async_watch_leaves_torch_as_it_was():
    from zerolearn.exercises.pending import COLLECTIVES, pending_reads

    before = {name: getattr(dist, name) for name in COLLECTIVES}
    wait = torch._C._distributed_c10d.Work.wait
    with pending_reads():
        assert all(getattr(dist, name) is not before[name] for name in COLLECTIVES)
    assert {name: getattr(dist, name) for name in COLLECTIVES} == before
    assert torch._C._distributed_c10d.Work.wait is wait
