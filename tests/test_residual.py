"""ZeRO-R (Sec 6): tensor parallelism, P_a, P_a+cpu, CB and MD, measured."""

import functools

import pytest
import torch

import jobs
import residual_jobs
from jobs import on_ranks
from zerolearn.chapters.ch05.lesson import VARIANTS  # the chapter's variants, tested at every stage
from zerolearn.figures import recorded_trace
from zerolearn.memory import model as analytic
from zerolearn.models import GPTConfig, build_model
from zerolearn.residual import defrag

pytestmark = pytest.mark.slow  # ZeRO-R measured on 4 ranks

STAGES = (0, 1, 2, 3)
RUNS = [dict(stage=s, **kw) for s in STAGES for kw in VARIANTS.values()]


@functools.cache
def results() -> list[dict]:
    return on_ranks(residual_jobs.many_residual, 4, RUNS)  # Nd x Nm = 2 x 2


@functools.cache
def reference_losses() -> list[float]:
    return jobs.reference("sgd", steps=3)["losses"]


def run(stage: int, variant: str, rank: int = 0) -> dict:
    return results()[rank][RUNS.index(dict(stage=stage, **VARIANTS[variant]))]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("stage", STAGES)
def test_2x2_with_and_without_pa_matches_single_process(stage, variant):
    ref = reference_losses()
    for rank in range(4):
        assert run(stage, variant, rank)["losses"] == pytest.approx(ref, rel=1e-5)


def test_checkpoint_bytes_per_rank_divide_by_nm():
    for stage in STAGES:
        plain = run(stage, "+ checkpointing")["checkpoint_bytes"]
        assert run(stage, "+ P_a")["checkpoint_bytes"] == (plain[0] // 2, 0)
        assert run(stage, "+ P_a+cpu")["checkpoint_bytes"] == (0, plain[0] // 2)  # on the host


def test_checkpoints_match_section_3_2_formula():
    # One checkpoint per block: batch x seq x hidden values (Sec 3.2), here fp32.
    cfg, local_batch = jobs.GPT, jobs.BATCH // 2
    expected = analytic.activation_bytes(cfg.d_model, local_batch, cfg.seq_len, cfg.n_layer,
                                         bytes_per_value=4, checkpointing=True)
    assert run(0, "+ checkpointing")["checkpoint_bytes"][0] == expected


def test_checkpointing_cuts_measured_activation_memory():
    for stage in STAGES:
        assert run(stage, "+ checkpointing")["activation_bytes"] < run(stage, "Nm = 2")["activation_bytes"]
        assert run(stage, "+ P_a")["activation_bytes"] < run(stage, "+ checkpointing")["activation_bytes"]


def test_pa_adds_one_allgather_per_block_under_a_tenth_of_mp_traffic():
    cfg, local_batch, steps = jobs.GPT, jobs.BATCH // 2, 3
    tags = run(0, "+ P_a")["by_tag"]
    block = local_batch * cfg.seq_len * cfg.d_model
    assert tags["pa"]["all_gather"]["elements"] == steps * cfg.n_layer * block
    # Megatron with recomputation: six all-reduces of a block's activations per block.
    assert tags["tp"]["all_reduce"]["elements"] == steps * cfg.n_layer * 6 * block
    ratio = tags["pa"]["all_gather"]["elements"] / (2 * tags["tp"]["all_reduce"]["elements"])
    assert ratio == pytest.approx(analytic.pa_overhead_ratio(cfg.seq_len, local_batch, cfg.d_model))
    assert ratio < 0.1


def test_constant_size_buffers_stay_under_the_cap_as_the_model_grows():
    cap_mb = 0.1
    for stage in STAGES:
        small, large = (on_ranks(residual_jobs.fused_buffer_peak, 2, stage, w, layers, cap_mb)[0]
                        for w, layers in ((64, 4), (128, 8)))
        assert large["psi"] > 3 * small["psi"]
        assert small["peak"] <= cap_mb * 2**20 and large["peak"] <= cap_mb * 2**20
        # "Fuse everything" grows with Psi (Sec 6.2's 3B-parameter, 12 GB example); under
        # ZeRO-3 a group never crosses a unit, so there it grows with the largest unit.
        naive = on_ranks(residual_jobs.fused_buffer_peak, 2, stage, 128, 8, 1024.0)[0]
        assert naive["peak"] >= (large["psi"] * 4 if stage < 3 else 128 * 129 * 4)


def test_recorded_trace_follows_real_tensors_lifetimes():
    # A small GPT, two recorded steps: the lifetime classes are Sec 6.3's, sized by the model.
    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)
    trace = defrag.record_gpt_steps(cfg, batch_size=4)
    psi_bytes = sum(p.numel() * 4 for p in build_model("gpt", 0, gpt=cfg).parameters())
    classes = defrag.lifetime_classes(trace)
    allocated = {}  # bytes allocated over the trace, per lifetime class
    for event, uid, nbytes, _ in trace:
        if event == "alloc" and uid in classes:
            allocated[classes[uid]] = allocated.get(classes[uid], 0) + nbytes
    assert allocated["setup->end"] == psi_bytes  # the parameters, never freed
    assert allocated["step->end"] == 2 * psi_bytes  # Adam's two moments, made by the first step
    assert allocated["backward->step"] == 2 * psi_bytes  # each step's gradients, freed by zero_grad
    checkpoints = [n for e, u, n, _ in trace if e == "alloc" and classes.get(u) == "forward->backward"]
    assert checkpoints.count(4 * 32 * 32 * 4) >= 2 * cfg.n_layer  # each block's input, in each step
    fused = [n for e, _, n, phase in trace if e == "alloc" and phase == "step" and n == psi_bytes]
    assert len(fused) == 2  # the flattened gradients, once per step


def test_allocator_fails_with_free_memory_on_a_real_trace_and_md_fixes_it():
    # Sec 6.3 on two real training steps (recorded, replayed through the caching-allocator
    # model): in the least memory that suffices with MD, the run without MD fails with
    # over 30% of memory free, on the step's one large request, the flattened gradients.
    trace = recorded_trace()
    psi_bytes = sum(p.numel() * 4 for p in build_model("gpt", 0, gpt=GPTConfig(**defrag.FRAGMENTING_GPT)).parameters())
    capacity = defrag.smallest_capacity(trace, md=True)
    assert defrag.replay(trace, capacity, md=True).ok
    without = defrag.replay(trace, capacity, md=False)
    assert not without.ok and without.free_fraction > 0.3
    assert without.failed_bytes == psi_bytes and trace[without.failed_event][3] == "step"
    assert without.free_bytes_at_failure > psi_bytes  # enough memory free, not in one piece
    assert defrag.smallest_capacity(trace, md=False) > capacity
    # MD done for real in the step (a checkpoint pool, gradients in one flat buffer),
    # replayed with no simulated pools, fits in that same memory.
    real_md = defrag.record_gpt_steps(md=True)
    assert defrag.replay(real_md, capacity, md=False).ok


def test_real_md_step_keeps_checkpoints_and_gradients_in_pools():
    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)
    psi_bytes = sum(p.numel() * 4 for p in build_model("gpt", 0, gpt=cfg).parameters())
    trace = defrag.record_gpt_steps(cfg, batch_size=4, md=True)
    classes = defrag.lifetime_classes(trace)
    allocated = {}
    for event, uid, nbytes, _ in trace:
        if event == "alloc" and uid in classes:
            allocated.setdefault(classes[uid], []).append(nbytes)
    assert "backward->step" not in allocated  # no gradient is allocated and freed per step
    assert allocated["setup->end"].count(psi_bytes) >= 1  # the flat gradient buffer, made once
    assert 2 * 32 * 4 * 32 * 4 in allocated["forward->end"]  # the checkpoint pool: n_layer x b s h fp32
    assert not any(p == "step" and n == psi_bytes for e, _, n, p in trace if e == "alloc")  # nothing to flatten


def test_cuda_fragmentation_reads_torch_memory_stats():
    stats = {"allocated_bytes.all.current": 10, "allocated_bytes.all.peak": 60, "reserved_bytes.all.current": 80,
             "reserved_bytes.all.peak": 100, "inactive_split_bytes.all.current": 5,
             "inactive_split_bytes.all.peak": 30, "num_alloc_retries": 2, "num_ooms": 1}
    out = defrag.cuda_fragmentation(stats)
    assert out["allocated_peak"] == 60 and out["reserved_peak"] == 100 and out["inactive_split_peak"] == 30
    assert out["alloc_retries"] == 2 and out["ooms"] == 1 and out["fragmentation"] == pytest.approx(0.4)
    assert defrag.cuda_fragmentation({})["fragmentation"] == 0.0
    if torch.cuda.is_available():
        plain, md = defrag.cuda_memory(md=False), defrag.cuda_memory(md=True)
        assert plain["allocated_peak"] > 0 and md["allocated_peak"] > 0
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            defrag.cuda_memory()


def test_caching_arena_gives_back_empty_segments_but_not_pinned_ones():
    mib = 2**20
    arena = defrag.CachingArena(capacity=40 * mib)
    assert arena.alloc(0, 8 * mib) and arena.alloc(1, 8 * mib)  # one 20 MiB segment, 4 MiB left
    assert arena.alloc(2, 12 * mib) and arena.reserved == 32 * mib  # its own 12 MiB segment
    arena.free(2)
    assert arena.alloc(3, 16 * mib)  # refused at first; the empty 12 MiB segment is given back
    assert arena.reserved == 36 * mib
    arena.free(3)
    arena.free(0)  # the 20 MiB segment still holds block 1: 12 MiB free in it, but pinned
    assert not arena.alloc(4, 24 * mib)  # 32 MiB free, 12 of them in the pinned segment: no 24 in one piece
    assert arena.reserved == 20 * mib and arena.segments[False][0].free_bytes == 12 * mib


def test_cli_2x2_with_pa_matches_1x1_and_reports_residual_memory_and_traffic():
    from zerolearn.config import TrainConfig
    from zerolearn.train import train

    run = TrainConfig(steps=2, quiet=True, global_batch_size=8, seq_len=16, n_layer=2, d_model=32, n_head=2, stage=3)
    single = on_ranks(train, 1, run)[0]
    report = on_ranks(train, 4, run.replace(tensor_parallel=2, checkpoint_activations=True,
                                            partition_activations=True))[0]
    assert report["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert report["data_parallel"] == 2 and report["tensor_parallel"] == 2
    for entry in report["ranks"]:
        residual = entry["residual"]
        assert residual["checkpoint_bytes_device"] == report["analytic"]["residual"]["checkpoint_bytes"]
        assert residual["checkpoint_bytes_host"] == 0 and residual["temp_buffer_peak_bytes"] > 0
        tags = entry["comm_by_tag"]
        ratio = tags["pa"]["all_gather"]["elements"] / (2 * tags["tp"]["all_reduce"]["elements"])
        assert ratio == pytest.approx(report["analytic"]["residual"]["pa_overhead_ratio"])


@pytest.mark.parametrize("args, message", [
    (["--partition-activations"], "--partition-activations needs --checkpoint-activations"),
    (["--tensor-parallel", "2"], "--tensor-parallel 2: must be >= 1 and divide the world size 1"),
    (["--model", "mlp", "--checkpoint-activations"], "apply to --model gpt"),
])
def test_zero_r_options_are_checked_before_any_work(args, message):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "zerolearn.train", *args], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and message in done.stderr
