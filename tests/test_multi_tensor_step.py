"""One multi-tensor optimizer step over a rank's flat masters (CUDA), checked on the CPU.

The CPU steps master by master (its numbers are the stored notebooks'); on CUDA the engine
steps every master in one fused call (``optim.multi_tensor_kind``). Here the choice is
checked by device type, and the multi-tensor path, forced on the CPU, must give the
per-master path's numbers, overflowed steps included: ``foreach`` to 1e-6 (it is the
same arithmetic, and in fact bit for bit), ``fused`` (the CUDA choice: its overflow flag
taken inside the kernel, its state shared with the per-master optimizers) to 1e-4 in the
parameters after four steps of lr 1e-2: torch's fused CPU kernel rounds Adam's update
otherwise, which shows where a gradient is near ``eps`` (Adam divides by ~eps there).
"""

from __future__ import annotations

import pytest
import torch

from jobs import global_batch, gpt_loss, on_ranks, small_gpt
from zerolearn.engines import optim

pytestmark = pytest.mark.quick

KINDS = (None, "foreach", "fused")
TOLERANCE = {"foreach": dict(rtol=1e-6, atol=1e-6), "fused": dict(rtol=1e-3, atol=1e-4)}
CONFIGS = [("adam", {}), ("adamw", {"weight_decay": 0.1}), ("sgd", {"momentum": 0.9}),
           ("adam", {"max_grad_norm": 0.5})]


def test_cuda_steps_all_masters_fused_and_the_cpu_master_by_master():
    assert optim.multi_tensor_kind(torch.device("cuda", 0)) == "fused"
    assert optim.multi_tensor_kind(torch.device("cpu")) is None
    masters = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    grouped = optim.make_grouped("adam", masters, lr=1e-3)
    assert grouped.multi is None
    assert all(not o.defaults.get("fused") and not o.defaults.get("foreach") for o in grouped.optimizers)
    with pytest.raises(Exception, match="step_all"):
        grouped.step_all()


def run_kinds(stages=(0, 1, 2, 3), steps: int = 4) -> dict:
    """On every rank: per (stage, optimizer, options, kind), the fp32 masters after ``steps``
    steps; step 2 carries an inf in one gradient of rank 0 (clipping then skips it)."""
    from zerolearn import data
    from zerolearn import dist as zdist
    from zerolearn.engines import make_engine

    ctx = zdist.context()
    out = {}
    for stage in stages:
        for name, options in CONFIGS:
            for kind in KINDS:
                lr = 0.1 if name == "sgd" else 1e-2
                engine = make_engine(stage, small_gpt(0), optimizer=name, lr=lr, bucket_mb=0.01, **options)
                engine.optimizer.multi = kind  # None: the CPU's own path
                param = engine.model.blocks[0].fc.weight
                stepped = []
                for step in range(steps):
                    x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in global_batch(step))
                    poison = step == 2 and ctx.rank == 0 and "max_grad_norm" in options
                    handle = param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))) \
                        if poison else None
                    engine.backward(gpt_loss(engine(x), y))
                    if handle is not None:
                        handle.remove()
                    stepped.append(bool(engine.step()))
                    engine.zero_grad()
                out[(stage, name, str(options), kind)] = (engine.full_state_dict(), stepped,
                                                          engine.optimizer.shard_state_dict()["state"])
                engine.close()
    return out


@pytest.mark.slow  # every stage, optimizer and option, twice
@pytest.mark.parametrize("world_size", [1, 2])
def test_multi_tensor_step_forced_on_the_cpu_matches_the_per_master_step(world_size):
    out = on_ranks(run_kinds, world_size)[0]
    assert len(out) == 4 * len(CONFIGS) * len(KINDS)  # stages 0-3
    for (stage, name, options, kind), (params, stepped, state) in out.items():
        if kind is None:
            continue
        where = f"stage {stage}, {name} {options}, {kind}, {world_size} rank(s)"
        ref, ref_stepped, ref_state = out[(stage, name, options, None)]
        assert stepped == ref_stepped, where
        if "max_grad_norm" in options:
            assert stepped[2] is False, where
        for n in ref:
            assert torch.allclose(params[n], ref[n], **TOLERANCE[kind]), f"{where}: {n}"
        for i in ref_state:
            for k, v in ref_state[i].items():
                assert torch.allclose(torch.as_tensor(state[i][k]).float().cpu(), torch.as_tensor(v).float(),
                                      **TOLERANCE[kind]), f"{where}: state {i} {k}"
