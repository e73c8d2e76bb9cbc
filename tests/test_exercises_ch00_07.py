"""The checkers of chapters 00, 01, 02, 06 and 07 accept every correct way of writing an
exercise, not only the reference solution's: other formulas, a list for a tuple, one
collective where the solution makes one per tensor."""

import pytest
import torch

from zerolearn import comm
from zerolearn.exercises import check
from zerolearn.memory import fit
from zerolearn.memory import model as analytic

pytestmark = pytest.mark.quick


def test_model_states_from_the_package_formula_pass():
    def model_state_bytes(psi, optimizer, dtype):
        name, momentum = {"adam": ("adam", True), "sgd_momentum": ("sgd", True), "sgd": ("sgd", False)}[optimizer]
        width = analytic.dtype_bytes(dtype)
        got = analytic.model_state_bytes(psi, 1, 0, k=analytic.optimizer_k(name, dtype, momentum),
                                         param_bytes=width, grad_bytes=width)
        return {c: got[c] for c in ("params", "grads", "optimizer_states")}

    assert check("00.model_state_bytes", model_state_bytes, quiet=True).passed


def test_max_batch_counted_up_one_sequence_at_a_time_passes():
    def max_batch(psi, device_bytes, hidden, seq_len, layers, checkpointing=False):
        batch = 0
        while 16 * psi + analytic.activation_bytes(hidden, batch + 1, seq_len, layers, 2,
                                                   checkpointing) <= device_bytes:
            batch += 1
        return batch

    assert check("00.max_batch", max_batch, quiet=True).passed


def test_table2_and_fit_from_the_package_pass():
    def max_psi(device_bytes, nd, stage, nm=1, k=12):
        return analytic.max_model_params(device_bytes, nd, stage, k=k, nm=nm)

    def fewest_gpus(psi, device_bytes, max_nd=1024):
        best = fit.smallest_fit(psi, device_bytes, max_nd=max_nd)
        return None if best is None else [best.stage, best.nd]  # a list reads as well as a tuple

    assert check("06.max_psi", max_psi, quiet=True).passed
    assert check("06.fewest_gpus", fewest_gpus, quiet=True).passed


def test_stage_choice_written_with_sets_and_the_package_passes():
    def stage_from_bytes(held, full):
        parted = {c for c in full if held[c] < full[c]}
        for stage, states in enumerate(([], ["optimizer_states"], ["optimizer_states", "grads"],
                                        ["optimizer_states", "grads", "params"])):
            if parted == set(states):
                return stage
        raise ValueError(f"partitioned {sorted(parted)}: no stage")

    def choose_stage(psi, device_bytes, nd, residual_bytes=0):
        fits = [s for s in range(4) if analytic.model_state_bytes(psi, nd, s)["total"] + residual_bytes
                <= device_bytes]
        return min(fits, default=None)

    assert check("07.stage_from_bytes", stage_from_bytes, quiet=True).passed
    assert check("07.choose_stage", choose_stage, quiet=True).passed


def average_in_one_collective(model, world_size):
    """Every gradient in one flat buffer, one all-reduce: the same 2 Psi, one call."""
    grads = [p.grad for p in model.parameters()]
    buffer = torch.cat([g.flatten() for g in grads])
    comm.all_reduce(buffer)
    buffer /= world_size
    offset = 0
    for g in grads:
        g.copy_(buffer[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@pytest.mark.slow  # the exercise on fresh ranks
def test_naive_dp_in_one_flat_all_reduce_passes():
    assert check("01.average_gradients", average_in_one_collective, quiet=True).passed
