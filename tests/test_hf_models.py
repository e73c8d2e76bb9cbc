"""Models nobody here wrote, at every stage, against one process on the whole batch.

Hugging Face BERT (masked LM), T5, ViT, ALBERT, Qwen2 with tied embeddings and BART,
tiny configs built in code (nothing downloaded), and torch's own ``nn.Transformer``.
SGD with momentum 0.9: no division by a running variance, so the parameters must
agree to rounding, not to Adam's looser tolerance. All models and stages of a world
size run inside one set of rank processes.
"""

import functools
import importlib.util

import pytest
import user_model_jobs

from jobs import on_ranks

pytestmark = pytest.mark.slow  # Hugging Face models at every stage on 2 and 3 ranks

STAGES = (0, 1, 2, 3)
SGD = dict(optimizer="sgd", momentum=0.9, lr=0.05)
# ZeRO-3 with one unit per layer as well as the default (the model's children): Hugging
# Face's parents read their children's parameters only through the children.
FINE_UNITS = {"bert": ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"],
              "qwen2_tied": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"],
              "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]}
CASES = [(kind, stage, None) for kind in user_model_jobs.HF_KINDS for stage in STAGES] + \
        [(kind, 3, units) for kind, units in FINE_UNITS.items()]
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed (pip install .[hf])")


@functools.cache
def reference(kind: str) -> dict:
    return user_model_jobs.train(kind, None, **SGD)


@needs_hf
@pytest.mark.parametrize("world_size", [2, 3])
def test_models_nobody_here_wrote_train_as_one_process_at_every_stage(world_size):
    out = on_ranks(user_model_jobs.many, world_size,
                   [dict(kind=kind, stage=stage, units=units, **SGD) for kind, stage, units in CASES])[0]
    for (kind, stage, units), run in zip(CASES, out, strict=True):
        where = f"{kind} at stage {stage}" + (f" with units {units}" if units else "")
        assert not isinstance(run, str), f"{where}: {run}"
        ref = reference(kind)
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6), where
        assert user_model_jobs.rel_error(run["params"], ref["params"]) < 1e-6, where
