"""Flat buffers: padded to equal shards, views that share memory."""

import dataclasses

import pytest
import torch
from torch import nn

from zerolearn.flat import FlatLayout, make_buckets

pytestmark = pytest.mark.quick


def test_flat_group_pads_to_equal_shards_whatever_the_layer_sizes():
    params = [nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7))]  # 22 elements
    groups = [FlatLayout.of(["a", "b"], [p.shape for p in params], num_shards=4, shard_index=r)
              for r in range(4)]
    assert groups[0].numel == 22 and groups[0].padded_numel == 24 and groups[0].padding == 2
    assert [g.shard_range for g in groups] == [(0, 6), (6, 12), (12, 18), (18, 24)]


def test_bound_parameters_are_views_of_the_flat_buffer():
    params = [nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7))]
    original = [p.detach().clone() for p in params]
    g = FlatLayout.of(["a", "b"], [p.shape for p in params], num_shards=3, shard_index=0)
    flat = g.flatten(params, torch.float32, torch.device("cpu"))
    g.bind(params, flat)
    assert all(torch.equal(p, o) for p, o in zip(params, original, strict=True))
    flat.zero_()
    assert all(torch.count_nonzero(p) == 0 for p in params)  # shared memory, no copies
    assert flat[g.numel:].numel() == g.padding


def test_make_buckets_caps_bucket_size_but_never_splits_a_parameter():
    named = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([100, 100, 300, 50])]
    groups = make_buckets(named, bucket_bytes=200 * 4, element_size=4, num_shards=2, shard_index=0)
    assert [g.names for g in groups] == [("p0", "p1"), ("p2",), ("p3",)]


def test_a_layout_is_immutable_and_knows_its_shard():
    g = FlatLayout.of(["a", "b", "c"], [torch.Size([10]), torch.Size([7]), torch.Size([6])], num_shards=4,
                      shard_index=3)
    assert (g.padding, g.shard_range, g.offsets) == (1, (18, 24), (0, 10, 17))
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.numel = 0


def test_the_default_bucket_policy_is_large_buckets_with_ddps_small_first_one_on_gpus():
    from zerolearn.flat import DEFAULT_BUCKET_MB, FIRST_BUCKET_MB, bucket_caps
    assert bucket_caps(None, "cuda") == (int(FIRST_BUCKET_MB * 2**20), int(DEFAULT_BUCKET_MB * 2**20)) \
        == (2**20, 25 * 2**20)
    assert bucket_caps(None, "cpu") == (25 * 2**20, 25 * 2**20)
    assert bucket_caps(0.5, "cuda") == bucket_caps(0.5, "cpu") == (2**19, 2**19)
    # 6 parameters of 0.4 MiB (fp32): on a GPU the first bucket closes at 1 MiB (2 of them), the rest share one.
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(int(0.4 * 2**20) // 4))) for i in range(6)]
    first, rest = bucket_caps(None, "cuda")
    layouts = make_buckets(named, rest, 4, num_shards=2, shard_index=0, first_bucket_bytes=first)
    assert [layout.names for layout in layouts] == [("p0", "p1"), ("p2", "p3", "p4", "p5")]
    first, rest = bucket_caps(None, "cpu")
    assert len(make_buckets(named, rest, 4, num_shards=2, shard_index=0, first_bucket_bytes=first)) == 1
