"""Mixture-of-experts models at every stage, against one process on the whole batch.

A router sends each token to its best experts; an expert no token chose on a rank is
not called there, so its parameters get gradients on some ranks only, inside a unit
(a transformer block) that runs on every rank. DDP (``find_unused_parameters``) is
exact there; so must every stage be, ZeRO-3 with blocks as units included: each rank
reduce-scatters the block's whole gradient, zeros for the idle experts, in one order.

Models: a hand-written top-1 and top-2 router over 8 small MLPs whose last two experts
are rarely chosen, and Hugging Face Mixtral, Qwen2-MoE and Switch Transformer tiny
configs built in code (Switch with an expert capacity of 2 tokens per sequence, so
tokens are dropped and experts go idle). SGD with momentum: parameters agree to
rounding.
"""

import functools
import importlib.util

import pytest
import user_model_jobs

from jobs import on_ranks

pytestmark = pytest.mark.slow  # mixture-of-experts models on ranks

STAGES = (0, 1, 2, 3)
SGD = dict(optimizer="sgd", momentum=0.9, lr=0.05)
BLOCKS = {"moe_top1": ["emb", "blocks.0", "blocks.1", "head"], "moe_top2": ["emb", "blocks.0", "blocks.1", "head"],
          "mixtral": ["model.layers.0", "model.layers.1"], "qwen2_moe": ["model.layers.0", "model.layers.1"],
          "switch": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]}
HF = ("mixtral", "qwen2_moe", "switch")
# Models whose experts go idle on some ranks in some step of this data (checked, so the
# case the test exists for cannot silently stop happening).
IDLE = ("moe_top1", "moe_top2", "switch")
HAS_HF = importlib.util.find_spec("transformers") is not None
KINDS = [k for k in BLOCKS if HAS_HF or k not in HF]


@functools.cache
def reference(kind: str) -> dict:
    return user_model_jobs.train(kind, None, **SGD)


@pytest.mark.parametrize("world_size", [2, 3])
def test_experts_idle_on_some_ranks_train_as_one_process_at_every_stage(world_size):
    cases = [(kind, stage) for kind in KINDS for stage in STAGES]
    out = on_ranks(user_model_jobs.many, world_size,
                   [dict(kind=kind, stage=stage, units=BLOCKS[kind] if stage == 3 else None, **SGD)
                    for kind, stage in cases])
    assert len(cases) >= 2 * len(STAGES)  # moe_top1 and moe_top2 at least, with or without transformers
    assert len(out) == world_size and all(len(rank_out) == len(cases) for rank_out in out)
    for i, (kind, stage) in enumerate(cases):
        where = f"{kind} at stage {stage}" + (" with blocks as units" if stage == 3 else "")
        runs = [rank_out[i] for rank_out in out]
        for run in runs:
            assert not isinstance(run, str), f"{where}: {run}"
        ref = reference(kind)
        assert runs[0]["losses"] == pytest.approx(ref["losses"], rel=1e-6), where
        assert user_model_jobs.rel_error(runs[0]["params"], ref["params"]) < 1e-6, where
        if stage == 3 and kind in IDLE:
            assert any(run["uneven"] for run in runs), f"{where}: no expert was idle on a rank"


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed (pip install .[hf])")
def test_a_module_dict_with_a_forward_of_its_own_is_a_unit():
    # Switch Transformer's experts are a ModuleDict subclass whose forward routes the tokens.
    units = ["encoder.block.0", "encoder.block.1.layer.1.mlp.experts", "decoder.block.1.layer.2.mlp.experts"]
    out = on_ranks(user_model_jobs.many, 2, [dict(kind="switch", stage=3, units=units, **SGD)])
    run, ref = out[0][0], reference("switch")
    assert not isinstance(run, str), run
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-6
