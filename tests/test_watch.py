"""The ledger watches torch.distributed: collectives called by torch's own names are booked
(calls, elements, bytes) as comm's are, once, sync or async; bookkeeping is not."""

import pytest
import torch
import torch.distributed as dist

from jobs import on_ranks
from zerolearn import comm
from zerolearn.watch import watching

pytestmark = pytest.mark.quick


def torch_named(n: int) -> dict:
    """Each of torch's four collectives once (one async), plus comm's all_reduce and bookkeeping."""
    ws = dist.get_world_size()
    t = torch.ones(n * ws)
    comm.LEDGER.reset()
    with watching() as ledger:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        out = torch.empty(n)
        dist.reduce_scatter_single(out, t)
        full = torch.empty(n * ws, dtype=torch.bfloat16)
        dist.all_gather_single(full, out.bfloat16())
        dist.broadcast(t, src=0)
        comm.all_reduce(t)  # booked by comm, not twice
        dist.all_gather_object([None] * ws, {"rank": dist.get_rank()})  # bookkeeping: not booked
        dist.barrier()
    outside = torch.ones(3)
    dist.all_reduce(outside)  # not watched: not booked
    return {"ledger": ledger.as_dict(), "volume": ledger.volume_elements(), "sum": t[0].item()}


@pytest.mark.parametrize("world_size", [2])
def test_torch_named_collectives_are_booked_once_each(world_size):
    n = 5
    results = on_ranks(torch_named, world_size, n)
    assert len(results) == world_size
    for r in results:
        e = n * world_size
        got = r["ledger"]
        assert got["all_reduce"] == {"calls": 3, "elements": 3 * e, "bytes": 12 * e}
        assert got["reduce_scatter"] == {"calls": 1, "elements": e, "bytes": 4 * e}
        assert got["all_gather"] == {"calls": 1, "elements": e, "bytes": 2 * e}  # bf16
        assert got["broadcast"] == {"calls": 1, "elements": e, "bytes": 4 * e}
        assert r["volume"] == 2 * 3 * e + e + e + e


def test_watching_outside_a_process_group_changes_nothing():
    with watching() as ledger:
        x = torch.ones(4) * 2
    assert x.sum().item() == 8 and ledger is comm.LEDGER
