"""TrainConfig: one place for every option; Python and the command line meet in it."""

import dataclasses
import re

import pytest

from zerolearn.config import TrainConfig, build_parser
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.quick


def test_every_field_is_a_flag_and_the_command_line_round_trips():
    flags = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(stage=3, model="gpt", dtype="bf16", lr=0.02, max_grad_norm=1.5, memory_timeline=True,
                         checkpoint_activations=True, partition_activations=True, tensor_parallel=2,
                         simulate_world_size=8, fail_mode="hang", prefetch_mb=0.0)
    argv = config.to_argv()
    assert "--stage" in argv and "--memory-timeline" in argv and "--model" not in argv  # defaults left out
    assert TrainConfig.from_argv(argv) == config
    assert TrainConfig.from_argv([]) == TrainConfig()


def test_a_misspelled_option_fails_in_the_callers_process():
    with pytest.raises(TypeError, match="stge"):
        TrainConfig(stge=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), "--steps 0: must be an integer >= 1"),
    (dict(stage=4), "--stage 4: allowed are 0, 1, 2, 3"),
    (dict(dtype="int8"), "--dtype 'int8': allowed are fp32, bf16, fp16"),
    (dict(lr=float("nan")), "--lr nan: must be a finite number > 0"),
    (dict(momentum=-0.5), "--momentum -0.5: must be a finite number >= 0"),
    (dict(prefetch_mb=float("inf")), "--prefetch-mb inf: must be a finite number >= 0"),
    (dict(d_model=30, n_head=4), "--d-model 30 is not divisible by --n-head 4"),
    (dict(partition_activations=True), "--partition-activations needs --checkpoint-activations"),
    (dict(checkpoint_every=2), "--checkpoint-every needs --checkpoint-dir"),
    (dict(simulate_world_size=0), "--simulate-world-size 0: must be an integer >= 1"),
    (dict(model="mlp", tensor_parallel=2), "apply to --model gpt"),
    (dict(seed=2**32), "--seed 4294967296: too large; allowed are up to 4294967295"),
    (dict(steps=2**63), "--steps 9223372036854775808: too large; allowed are up to 9223372036854775807"),
    (dict(timeout=1e300), "--timeout 1e+300: too large; allowed are up to 2147483647"),
])
def test_bad_values_are_refused_when_the_config_is_built(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**kwargs)
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig().replace(**kwargs)  # a changed copy is checked like a new one


@pytest.mark.parametrize("kwargs, world, message", [
    (dict(global_batch_size=12), 5, "--global-batch-size 12 is not divisible by world size 5"),
    (dict(global_batch_size=12, grad_accum_steps=4), 2, "allowed are multiples of 8"),
    (dict(tensor_parallel=2), 3, "--tensor-parallel 2: must be >= 1 and divide the world size 3"),
    (dict(global_batch_size=6, tensor_parallel=2), 8, "not divisible by Nd = 4 data-parallel groups"),
    (dict(fail_at_step=1, fail_rank=2), 2, "--fail-rank 2: allowed are 0 to 1 (world size 2)"),
])
def test_checks_that_need_the_world_size(kwargs, world, message):
    config = TrainConfig(**kwargs)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.validate(world)


def test_validate_returns_the_data_parallel_degree():
    assert TrainConfig(global_batch_size=8).validate(4) == 4
    assert TrainConfig(global_batch_size=8, tensor_parallel=2).validate(4) == 2
