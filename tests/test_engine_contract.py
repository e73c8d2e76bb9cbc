"""The engine contract: four methods make a stage, and a stage written to it alone trains exactly.

``AllReduceZero1`` below is a fifth engine that implements only the contract's
required methods (``zerolearn.engines.base.Engine``'s docstring): ZeRO-1 as it is
often first written, the gradient all-reduced and each rank stepping its 1/Nd
shard of the optimizer state, then the updated shards all-gathered. It trains like
one process on the global batch, as the four real stages do, but moves 3 Psi per
step where :class:`~zerolearn.engines.zero1.Zero1Engine`'s reduce-scatter moves
2 Psi (as DP's, paper Sec 1 and Sec 7): the contract makes a stage correct, not efficient.
"""

import functools

import pytest
import torch
from test_equivalence import PARAM_TOLERANCE, rel_error

import jobs
from jobs import on_ranks
from zerolearn import comm, guard
from zerolearn.engines.base import Engine

pytestmark = pytest.mark.quick


class AllReduceZero1(Engine):
    """ZeRO-1 by all_reduce: full params and grads, sharded optimizer state; 3 Psi per step."""

    def _init_bucket(self, b, master32):
        b.full = master32.to(self.dtype)
        b.layout.bind(b.params, b.full)
        b.master = torch.nn.Parameter(b.layout.shard_of(master32).clone())

    def _reduce(self, b):
        return comm.all_reduce(b.grad_full, group=self.pg, async_op=True)  # 2 Psi, in place

    def _grad_for_step(self, b):
        return b.layout.shard_of(b.grad_full)

    def _publish(self, b):
        updated = b.master.detach().to(self.dtype, copy=True)
        self._publishing.append(comm.all_gather(b.full, updated, group=self.pg, async_op=True))  # Psi


class NoPublish(Engine):
    """Forgets :meth:`_publish`: its updates would never reach the model."""

    def _init_bucket(self, b, master32):
        b.full = master32.to(self.dtype)
        b.layout.bind(b.params, b.full)
        b.master = torch.nn.Parameter(master32)

    def _reduce(self, b):
        return comm.all_reduce(b.grad_full, group=self.pg, async_op=True)

    def _grad_for_step(self, b):
        return b.grad_full


RUNS = [dict(stage=-1, engine_cls=AllReduceZero1, optimizer=o) for o in ("sgd", "adam")]
EXTRA = [dict(stage=-1, engine_cls=AllReduceZero1, optimizer="sgd", max_grad_norm=0.5),
         dict(stage=-1, engine_cls=AllReduceZero1, optimizer="sgd", accum=2, accum_style="repeated"),
         dict(stage=-1, engine_cls=AllReduceZero1, optimizer="adam", dtype="bf16")]


@functools.cache
def results(world_size: int) -> list[dict]:
    return on_ranks(jobs.many, world_size, RUNS + EXTRA)[0]


@functools.cache
def reference(optimizer: str, **kw) -> dict:
    return jobs.reference(optimizer, **kw)


def test_the_contract_is_four_required_methods():
    assert Engine.__abstractmethods__ == {"_init_bucket", "_reduce", "_grad_for_step", "_publish"}


def test_an_engine_missing_a_required_method_fails_at_construction_naming_it():
    # Before any process group or allocation: abc refuses the class itself.
    with pytest.raises(TypeError, match=r"NoPublish.*_publish"):
        NoPublish(jobs.small_gpt())


@pytest.mark.parametrize("optimizer", list(PARAM_TOLERANCE))
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_engine_written_to_the_contract_alone_matches_single_process(world_size, optimizer):
    ref = reference(optimizer)
    run = results(world_size)[RUNS.index(dict(stage=-1, engine_cls=AllReduceZero1, optimizer=optimizer))]
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert rel_error(run["params"], ref["params"]) < PARAM_TOLERANCE[optimizer]


def test_the_contract_engine_clips_accumulates_and_runs_mixed_precision():
    clipped, accumulated, bf16 = results(2)[len(RUNS):]
    ref = reference("sgd", max_grad_norm=0.5)  # the norm is summed over the ranks' shards
    assert clipped["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert rel_error(clipped["params"], ref["params"]) < 1e-5
    assert rel_error(accumulated["params"], reference("sgd")["params"]) < 1e-5
    assert rel_error(bf16["params"], reference("adam")["params"]) < 5e-2  # as the real stages


def test_the_contract_engine_shards_the_optimizer_but_moves_three_psi():
    run = results(2)[RUNS.index(dict(stage=-1, engine_cls=AllReduceZero1, optimizer="adam"))]
    padded, steps = run["psi"] + run["padding"], 4  # Psi plus each group's padding to Nd shards
    assert run["bytes"]["optimizer_states"] == 3 * 4 * padded // 2  # fp32 master + 2 moments, 1/Nd
    assert run["ledger"]["all_reduce"]["elements"] == steps * padded  # 2 Psi in the paper's count
    assert run["ledger"]["all_gather"]["elements"] == steps * padded  # Psi more
    assert run["ledger"]["reduce_scatter"]["calls"] == 0
    assert run["comm_per_step"] == 3 * padded  # Zero1Engine: 2 Psi


def test_collectives_are_labelled_explicitly_and_the_outer_label_wins():
    assert guard.calling_unit() == ("-", "-")
    with comm.unit("blocks.1", "forward: gather"):
        assert guard.calling_unit() == ("blocks.1", "forward: gather")
        with comm.unit("bucket[a..b]", "backward: reduce"):
            assert guard.calling_unit() == ("blocks.1", "forward: gather")
    assert guard.calling_unit() == ("-", "-")
