"""The engines' optimizer over flat masters steps exactly as torch's optimizer does
(zerolearn/engines/optim.py): on the CPU a large master is stepped chunk by chunk."""

import pytest
import torch
from torch import nn

from zerolearn.engines import optim

pytestmark = pytest.mark.quick

N = 3 * optim.CPU_CHUNK + 5  # several chunks and a short last one


def _trained(name: str, chunked: bool, steps: int = 4, **hyper) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    master = nn.Parameter(torch.randn(N))
    grads = [torch.randn(N) for _ in range(steps)]
    if chunked:
        grouped = optim.make_grouped(name, [master], 1e-2, **hyper)
        for g in grads:
            master.grad = g.clone()
            grouped.step_bucket(0)
        state = grouped.optimizers[0].state[master]
    else:
        opt = optim.make_optimizer(name, [master], 1e-2, **hyper)
        for g in grads:
            master.grad = g.clone()
            opt.step()
        state = opt.state[master]
    return master.detach().clone(), {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("name,hyper", [("adam", {}), ("adam", {"weight_decay": 0.01}),
                                        ("adamw", {"weight_decay": 0.1}), ("sgd", {"momentum": 0.9}),
                                        ("sgd", {})])
def test_chunked_step_is_torchs_step_bit_for_bit(name, hyper):
    whole, whole_state = _trained(name, chunked=False, **hyper)
    chunked, chunked_state = _trained(name, chunked=True, **hyper)
    assert torch.equal(whole, chunked)
    assert whole_state.keys() == chunked_state.keys()
    for key, value in whole_state.items():
        assert torch.equal(value, chunked_state[key]), key


def test_parts_over_chunks_leave_the_rest_untouched():
    torch.manual_seed(0)
    master = nn.Parameter(torch.randn(N))
    grouped = optim.make_grouped("adam", [master], 1e-2)
    master.grad = torch.randn(N)
    grouped.step_bucket(0)  # one full step: step count 1 everywhere
    before = master.detach().clone()
    state = grouped.optimizers[0].state[master]
    moments = state["exp_avg"].clone()
    a, b = optim.CPU_CHUNK - 7, 2 * optim.CPU_CHUNK + 9  # a part across three chunks
    master.grad = torch.randn(N)
    grouped.step_bucket(0, [(a, b, 1)])
    assert torch.equal(master.detach()[:a], before[:a]) and torch.equal(master.detach()[b:], before[b:])
    assert torch.equal(state["exp_avg"][:a], moments[:a]) and torch.equal(state["exp_avg"][b:], moments[b:])
    # The part steps as that slice alone would under torch's Adam, at its second step.
    torch.manual_seed(0)
    whole = nn.Parameter(torch.randn(N))
    first = torch.optim.Adam([whole], lr=1e-2)
    whole.grad = torch.randn(N)
    first.step()
    part = nn.Parameter(whole.detach()[a:b].clone())
    second = torch.optim.Adam([part], lr=1e-2)
    second.state[part] = {k: (v[a:b].clone() if v.dim() else v.clone()) for k, v in first.state[whole].items()}
    part.grad = master.grad[a:b].clone()
    second.step()
    assert torch.equal(master.detach()[a:b], part.detach())
    assert int(state["step"]) == 2


@pytest.mark.parametrize("overflow", [False, True])
def test_a_step_result_reads_the_device_flag_once_and_acts_as_a_bool(overflow):
    import pickle

    stepped = optim.Stepped(torch.tensor(overflow))
    assert stepped._value is None  # nothing read until it is asked
    assert bool(stepped) is (not overflow) and stepped._found_inf is None  # read once, then dropped
    assert stepped == (not overflow) and stepped != overflow
    assert hash(stepped) == hash(not overflow) and repr(stepped) == repr(not overflow)
    assert {stepped: 1} == {not overflow: 1}
    assert pickle.loads(pickle.dumps(stepped)) is (not overflow)
