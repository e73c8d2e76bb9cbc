"""The gradient hook path: what each parameter's gradient costs the host beyond autograd.

Autograd calls the engine once per parameter (a post-accumulate-grad hook) to move that
gradient into its bucket. On a GPU every op the hook dispatches is host time between
kernels, so the path is held to: one copy (or add) per parameter, at most one view per
parameter, cut once per bucket per backward (``FlatLayout.views``: one
``split_with_sizes``), and no slicing per parameter. The ops are counted with a
``TorchDispatchMode`` around ``engine.backward`` and compared with the same model's
plain ``loss.backward()``.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from jobs import on_ranks

pytestmark = pytest.mark.quick

WIDTH, LAYERS = 8, 30  # 60 parameters


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _ops_in_backward(stage: int, bucket_mb: float | None) -> dict:
    from zerolearn.engines import make_engine

    x = torch.randn(4, WIDTH)
    plain = _model()
    with Count() as base:
        plain(x).sum().backward()
    engine = make_engine(stage, _model(), lr=1e-3, bucket_mb=bucket_mb)
    out = {}
    for _ in range(2):  # the second backward: buffers exist, nothing is built for the first time
        engine.zero_grad()
        loss = engine(x).sum()
        with Count() as seen:
            engine.backward(loss)
        engine.step()
        out = {"engine": dict(seen.ops), "plain": dict(base.ops), "params": len(list(plain.parameters())),
               "buckets": len(engine.buckets)}
    engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bucket_mb", [None, 0.001])
def test_each_gradient_costs_one_copy_and_one_view(stage, bucket_mb):
    r = on_ranks(_ops_in_backward, 1, stage, bucket_mb)[0]
    engine, plain, n, buckets = r["engine"], r["plain"], r["params"], r["buckets"]
    assert buckets > (1 if bucket_mb else 0)
    extra = {op: engine.get(op, 0) - plain.get(op, 0) for op in set(engine) | set(plain)}
    # Per parameter: one copy into its view of the bucket (no gradient here arrives twice).
    # Per bucket, a few more: the reduction's shard, ZeRO-3's gather and rebinding.
    assert n <= extra.get("copy_", 0) <= n + 2 * buckets, extra
    assert extra.get("view", 0) <= n + 2 * buckets, extra
    assert extra.get("split_with_sizes", 0) <= buckets, extra
    assert extra.get("slice", 0) <= 4 * buckets, extra  # none per parameter
