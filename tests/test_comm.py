"""zerolearn.comm's collectives: what the engines rely on beyond torch's own semantics."""

import pytest
import torch

from jobs import on_ranks
from zerolearn import comm
from zerolearn import dist as zdist

pytestmark = pytest.mark.quick


def reduce_scatter_both_ways(n: int) -> dict:
    """Each rank's chunk of the sum, by the plain reduce_scatter and by overwrite_input
    (sync and async); and what the input holds afterwards."""
    ctx = zdist.context()
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(n * ctx.world_size, generator=g) * 10 ** torch.randint(-3, 4, (n * ctx.world_size,), generator=g)
    plain, kept = torch.empty(n), x.clone()
    comm.reduce_scatter(plain, kept)
    out = {"plain": plain, "kept": kept, "x": x}
    for async_op in (False, True):
        given, got = x.clone(), torch.empty(n)
        handle = comm.reduce_scatter(got, given, async_op=async_op, overwrite_input=True)
        handle.wait()
        out[async_op] = (got, given)
    total = torch.empty(n * ctx.world_size)
    comm.all_gather(total, plain)
    out["sum"] = total
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_overwriting_its_input_gives_the_same_bits(world_size):
    results = on_ranks(reduce_scatter_both_ways, world_size, 1001)
    assert len(results) == world_size
    for rank, r in enumerate(results):
        assert torch.equal(r["kept"], r["x"])  # the plain one leaves its input alone
        for async_op in (False, True):
            got, given = r[async_op]
            assert torch.equal(got, r["plain"]), (rank, async_op)
            assert torch.equal(given, r["sum"]), (rank, async_op)  # gloo: the input holds the whole sum
