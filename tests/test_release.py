"""A run releases what it allocated: train() many times in one process holds no more
tensor memory than once, and an engine dropped or closed takes its buffers with it.

On a GPU a run that outlived itself would add its model states to every later run's peak
(the seed experiment in one process would print ZeRO-2 above ZeRO-1); on the CPU the same
leak shows as tensor storage still alive after the run, which is what these tests count.
"""

import gc
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.engines import make_engine
from zerolearn.errors import ConfigError
from zerolearn.models import build_model
from zerolearn.train import train

pytestmark = pytest.mark.slow  # engines trained and released on ranks

MIB = 2**20


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated names warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError, ReferenceError):
            continue  # a tensor with no storage (meta, sparse, a subclass without one)
        key = (storage.data_ptr(), storage.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


@pytest.fixture(scope="module")
def one_rank():
    zdist.init("gloo", "cpu", 60, None)
    yield
    zdist.teardown()


RUNS = {
    "stage 0": {"stage": 0},
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3},
    "stage 2 offload cpu": {"stage": 2, "offload": "cpu"},
    "stage 3 offload disk": {"stage": 3, "offload": "disk"},
    "stage 2 offload cpu dpu": {"stage": 2, "offload": "cpu", "dpu": True},
    "stage 3 checkpoint activations": {"stage": 3, "model": "gpt", "checkpoint_activations": True,
                                       "contiguous_checkpoints": True},
    "stage 3 ZeRO++": {"stage": 3, "qwz": True, "hpz": True, "qgz": True, "node_size": 1},
}


QUICK = ("stage 0", "stage 1", "stage 2", "stage 3")  # the options run in the full tier


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in RUNS])
def test_train_four_times_in_one_process_leaves_nothing_behind(one_rank, name, tmp_path):
    options = {"model": "mlp", "mlp_width": 512, "mlp_layers": 4, "steps": 2, "quiet": True, **RUNS[name]}
    if options.get("offload") == "disk":
        options["offload_dir"] = str(tmp_path)
    config = TrainConfig(**options)
    train(config)  # warm-up: lazily built caches (the corpus, kernels) stay, as they should
    after_first = live_tensor_bytes()
    for _ in range(3):
        report = train(config)
        del report
    grown = live_tensor_bytes() - after_first
    assert grown <= 1 * MIB, f"{name}: {grown / MIB:.2f} MiB of tensors outlived 3 runs"


@pytest.mark.parametrize("stage", range(4))
def test_an_engine_dropped_without_close_frees_its_buffers(one_rank, stage):
    before = live_tensor_bytes()
    model = build_model("mlp", 0, mlp_width=512, mlp_layers=4)
    engine = make_engine(stage, model)
    loss = engine(torch.randn(8, 512)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    held = live_tensor_bytes() - before
    assert held > 4 * 512 * 512 * 4  # the run held at least its fp32 parameters
    del engine, model, loss
    assert live_tensor_bytes() - before <= 64 * 1024


def test_close_releases_the_engine_and_refuses_to_train_after(one_rank):
    model = build_model("mlp", 0, mlp_width=512, mlp_layers=4)
    with make_engine(2, model) as engine:
        engine.backward(engine(torch.randn(8, 512)).pow(2).mean())
        engine.step()
        holding = live_tensor_bytes()
    released = holding - live_tensor_bytes()
    # masters (fp32 views at stage 2 in fp32 are the parameters), two Adam moments, gradient shards
    assert released >= 2 * sum(p.numel() for p in model.parameters()) * 4
    with pytest.raises(ConfigError, match="closed"):
        engine(torch.randn(8, 512))
    with pytest.raises(ConfigError, match="closed"):
        engine.step()
    engine.close()  # idempotent
    assert all(len(p._post_accumulate_grad_hooks or {}) == 0 for p in model.parameters())


@pytest.mark.slow
def test_seed_experiment_peaks_in_one_process_equal_one_process_per_stage(tmp_path):
    """The seed experiment's four stages in one process peak as each does alone, ZeRO-2 below ZeRO-1."""
    code = ("import json, sys\n"
            "from zerolearn.config import TrainConfig\n"
            "from zerolearn.train import train_here\n"
            "stages = [int(s) for s in sys.argv[1].split(',')]\n"
            "kw = dict(model='mlp', mlp_width=1024, mlp_layers=6, global_batch_size=16, steps=2,\n"
            "          simulate_world_size=2, bucket_mb=1, quiet=True)\n"
            "print(json.dumps([train_here(TrainConfig(stage=s, **kw))['ranks'][0]['peak_bytes'] for s in stages]))\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def peaks(stages: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", code, stages], capture_output=True, text=True, env=env,
                             timeout=300, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    together = peaks("0,1,2,3")
    alone = [peaks(str(s))[0] for s in range(4)]
    assert together == alone
    assert together[2] < together[1]
