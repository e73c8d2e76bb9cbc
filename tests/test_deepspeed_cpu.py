"""Chapter 7's DeepSpeed comparison: its config, its stored results, its errors."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zerolearn import data
from zerolearn.chapters.ch07 import lesson as ch07
from zerolearn.experiments import deepspeed_cpu
from zerolearn.models import build_model

pytestmark = pytest.mark.slow  # DeepSpeed's engine on gloo ranks

STORED = Path(__file__).resolve().parent.parent / "notebooks" / "data" / "deepspeed_cpu.json"


@pytest.mark.parametrize("stage", range(4))
def test_config_is_our_stage_with_our_optimizer_and_no_clipping(stage):
    conf = deepspeed_cpu.config(stage, 2)
    assert conf["zero_optimization"]["stage"] == stage
    assert conf["train_micro_batch_size_per_gpu"] * 2 == ch07.BATCH
    assert conf["gradient_clipping"] == 0.0  # DeepSpeed's default would clip at 1.0
    assert conf["optimizer"]["params"]["lr"] == ch07.LR and conf["optimizer"]["params"]["weight_decay"] == 0.0


def test_stored_deepspeed_losses_equal_single_process_training():
    # The stored runs must be the same training as one process with torch's Adam on the
    # same global batches; a run with other settings (clipping, say) fails this.
    model = build_model("gpt", 0, gpt=ch07.GPT)
    optimizer = torch.optim.Adam(model.parameters(), lr=ch07.LR)
    reference = []
    for step in range(4):
        x, y = data.gpt_batch(step, ch07.BATCH, ch07.GPT.seq_len)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reference.append(loss.item())
    stored = json.loads(STORED.read_text())
    assert sorted(stored) == [f"deepspeed, stage {s}" for s in range(4)]
    for run in stored.values():
        assert run["losses"] == pytest.approx(reference, abs=1e-5)
        assert run["world_size"] == 2 and run["bytes"]["optimizer_states"] > 0


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed")
def test_without_deepspeed_the_script_says_how_to_install_it(capsys):
    with pytest.raises(SystemExit) as info:
        deepspeed_cpu.main(["--stage", "1", "--out", "x.json"])
    assert info.value.code == 2
    assert "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed" in capsys.readouterr().err
