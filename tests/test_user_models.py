"""Models and loops users bring, at every stage, against one process on the whole batch.

Hugging Face GPT-2 (tied and untied embeddings) and Llama tiny configs (built in code,
nothing downloaded; ``pip install .[hf]``), a CNN with BatchNorm, weight tying written
by hand, gradient accumulation written three ways, and tensor parallelism with clipping
and fp16.
"""

import functools
import importlib.util

import pytest
import torch
import user_model_jobs

import jobs
from jobs import on_ranks

pytestmark = pytest.mark.slow  # users' models at every stage on ranks

STAGES = (0, 1, 2, 3)
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed (pip install .[hf])")


@functools.cache
def reference(kind: str) -> dict:
    return user_model_jobs.train(kind, None)


@functools.cache
def sgd_reference() -> dict:
    return jobs.reference("sgd")


HF = ("gpt2", "gpt2_untied", "llama")


@functools.cache
def hf_runs(world_size: int) -> list:
    # One set of rank processes per world size for every model and stage.
    return on_ranks(user_model_jobs.many, world_size, [dict(kind=kind, stage=s) for kind in HF for s in STAGES])[0]


def runs(kind: str, world_size: int) -> list:
    first = HF.index(kind) * len(STAGES)
    return hf_runs(world_size)[first:first + len(STAGES)]


# Adam divides by sqrt(v): rounding-level differences in near-zero gradients become
# differences of order lr in those parameters, so parameters agree to about 1e-2 of
# their norm while losses agree to 1e-5 (tests/test_equivalence.py says the same).
@needs_hf
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", HF)
def test_hugging_face_models_train_as_one_process_at_every_stage(kind, world_size):
    ref = reference(kind)
    for stage, run in zip(STAGES, runs(kind, world_size), strict=True):
        assert not isinstance(run, str), f"stage {stage}: {run}"
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"stage {stage}"
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-2, f"stage {stage}"


@needs_hf
def test_tied_gpt2_keeps_one_shared_weight_at_stage_3():
    # The tied weight is one model state, not two: the engine's Psi counts it once.
    run = runs("gpt2", 2)[3]
    assert "lm_head.weight" not in run["params"] or torch.equal(run["params"]["lm_head.weight"],
                                                                run["params"]["transformer.wte.weight"])


def test_batchnorm_trains_as_torch_ddp_with_rank_0s_buffers_on_every_rank():
    # BatchNorm normalizes with each rank's own batch, so the reference is torch DDP
    # (which broadcasts buffers from rank 0 before each forward), not one process.
    out = on_ranks(user_model_jobs.many, 2, [dict(kind="cnn", stage=None, ddp=True),
                                             *(dict(kind="cnn", stage=s) for s in STAGES)])
    ddp = out[0][0]
    for stage in STAGES:
        r0, r1 = out[0][stage + 1], out[1][stage + 1]
        assert r0["losses"] == pytest.approx(ddp["losses"], rel=1e-5), f"stage {stage}"
        assert user_model_jobs.rel_error(r0["params"], ddp["params"]) < 1e-2, f"stage {stage}"
        for name, value in r0["buffers"].items():
            assert torch.equal(value, r1["buffers"][name]), f"stage {stage}: {name} differs between ranks"
            assert torch.allclose(value.float(), ddp["buffers"][name].float(), rtol=1e-4, atol=1e-6), name


def test_a_weight_read_outside_its_unit_names_the_parameter_and_the_fix():
    out = on_ranks(user_model_jobs.many, 2, [dict(kind="hand_tied", stage=s) for s in STAGES])[0]
    ref = reference("hand_tied")
    for stage in (0, 1, 2):
        assert out[stage]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    message = out[3]
    assert isinstance(message, str) and message.startswith("ConfigError"), message
    assert "emb.weight" in message and "unit 0" in message and "units=" in message


@pytest.mark.parametrize("style", ["repeated", "no_sync", "sync"])
def test_accumulation_written_any_way_equals_one_large_batch(style):
    # 2 micro-batches per step. "repeated" is what a PyTorch user writes: backward
    # twice, then step. Keeping only the last micro-batch, or re-adding this rank's
    # unreduced gradient, fails this.
    runs_ = [dict(stage=s, optimizer="sgd", accum=2, accum_style=style) for s in STAGES]
    out = on_ranks(jobs.many, 2, runs_)[0]
    ref = sgd_reference()
    for stage, run in zip(STAGES, out, strict=True):
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"stage {stage}"
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-5, f"stage {stage}"


def test_reducing_and_local_micro_batches_mixed_in_one_step_equal_one_large_batch():
    # 3 micro-batches: reduce, add locally, reduce. A backward after a local one
    # must not take that local sum for an earlier reduced gradient (it is not reduced yet).
    runs_ = [dict(stage=s, optimizer="sgd", accum=3, accum_style="mixed") for s in STAGES]
    out = on_ranks(jobs.many, 2, runs_)[0]
    ref = sgd_reference()
    for stage, run in zip(STAGES, out, strict=True):
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-5, f"stage {stage}"


def test_accumulation_trades_traffic_for_memory_at_stage_2():
    # Repeated backward reduces every micro-batch (2x the reduce-scatter calls) but
    # holds only shards between them; no_sync reduces once but holds the full gradient.
    one, repeated, no_sync = on_ranks(jobs.many, 2, [dict(stage=2, optimizer="sgd", accum=a, accum_style=s)
                                                    for a, s in ((1, "sync"), (2, "repeated"), (2, "no_sync"))])[0]
    assert repeated["ledger"]["reduce_scatter"]["calls"] == 2 * no_sync["ledger"]["reduce_scatter"]["calls"]
    full_grad_bytes = 4 * repeated["psi"]  # fp32
    assert no_sync["peak_grad_bytes"] >= full_grad_bytes
    assert repeated["peak_grad_bytes"] < no_sync["peak_grad_bytes"]
    # Between micro-batches only shards are held: the peak is one micro-batch's peak
    # plus at most one reduced shard per group (the output of the adding reduction).
    assert repeated["peak_grad_bytes"] <= one["peak_grad_bytes"] + full_grad_bytes / 2


@pytest.mark.parametrize("dtype, clip", [("fp32", 0.05), ("fp16", None), ("fp16", 0.05)])
def test_tensor_parallel_clipping_and_fp16_match_the_run_without_it(dtype, clip):
    from zerolearn.config import TrainConfig
    from zerolearn.train import train

    run = TrainConfig(model="gpt", steps=3, global_batch_size=4, seq_len=16, n_layer=2, d_model=32, n_head=2,
                      dtype=dtype, stage=1, quiet=True, lr=0.01, max_grad_norm=clip)
    single = on_ranks(train, 1, run)[0]
    tp = on_ranks(train, 2, run.replace(tensor_parallel=2))[0]
    tol = 1e-5 if dtype == "fp32" else 2e-3
    assert tp["losses"] == pytest.approx(single["losses"], rel=tol)
