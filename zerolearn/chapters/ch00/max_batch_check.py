"""Exercise ``00.max_batch``'s check: the largest batch that fits beside the model states (paper Sec 3.2).

The largest batch whose activations fit beside the model states on one device, in this
process. The trial checks every case of ``BATCH_CASES`` against
:mod:`zerolearn.memory.model`: the answer fits, and one sequence more does not; a message
names the case and the bytes of model states and activations.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch00.max_batch`.
"""

from __future__ import annotations

import math

from zerolearn.chapters.ch00.max_batch import max_batch
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.memory import model as analytic

BATCH_CASES = (  # psi, device bytes, hidden, seq_len, layers, checkpointing
    (1_500_000_000, 32 * 10**9, 1600, 1024, 48, False),  # the paper's GPT-2 1.5B on a V100 (Sec 3)
    (1_500_000_000, 32 * 10**9, 1600, 1024, 48, True),
    (1_000_000, 16_000_000 + 3 * 98_304, 64, 32, 2, False),  # fills the device exactly at batch 3
    (2_100_000_000, 32 * 10**9, 1600, 1024, 48, True),  # model states alone exceed the device
    (7_500_000_000, 141 * 10**9, 4096, 2048, 32, True),
)


def _size(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if abs(n) >= 1e8 else f"{n:,.0f} bytes"


def _max_batch_trial(fn) -> str:
    """Every case of ``BATCH_CASES`` against ``memory.model``'s ``model_state_bytes`` and
    ``activation_bytes``: the answer fits, and one sequence more does not."""
    for psi, device, hidden, seq_len, layers, ckpt in BATCH_CASES:
        states = analytic.model_state_bytes(psi, 1, 0)["total"]
        per_sequence = analytic.activation_bytes(hidden, 1, seq_len, layers, 2, ckpt)
        want = max(0, math.floor((device - states) / per_sequence))
        call = (f"max_batch({psi:_}, {device:_}, hidden={hidden}, seq_len={seq_len}, layers={layers}"
                f"{', checkpointing=True' if ckpt else ''})")
        got = fn(psi, device, hidden, seq_len, layers, ckpt) if ckpt else fn(psi, device, hidden, seq_len, layers)
        if isinstance(got, bool) or not isinstance(got, int):
            raise Wrong(f"{call} returned {got!r}; expected an int number of sequences")
        if got == want:
            continue
        if states > device:
            raise Wrong(f"{call}: you say {got}; the model states alone ({_size(states)}) exceed the device "
                        f"({_size(device)}): no batch fits, so the answer is 0")
        hint = ""
        if got == math.floor(device / per_sequence):
            hint = " (the model states come first: 16 bytes per parameter before any activation)"
        elif got == math.floor((device - states) / (2 * per_sequence)):
            hint = " (activations are 2-byte values in mixed precision)"
        shown = got if got > want else want
        parts = f"{_size(states + shown * per_sequence)} ({_size(states)} of model states + " \
                f"{_size(shown * per_sequence)} of activations)"
        if got > want:
            raise Wrong(f"{call}: you say {got}; {got} sequences need {parts}, more than the device's "
                        f"{_size(device)}; the largest batch that fits is {want}{hint}")
        raise Wrong(f"{call}: you say {got}; {want} sequences fit: {parts}, at most the device's "
                    f"{_size(device)}{hint}")
    psi, device, hidden, seq_len, layers, _ = BATCH_CASES[0]
    return (f"all {len(BATCH_CASES)} cases right; GPT-2 1.5B on a 32 GB device fits "
            f"{fn(psi, device, hidden, seq_len, layers)} sequences of 1K tokens without checkpointing")


_rounds_up = edited(max_batch, {"int(left // per_sequence)": "math.ceil(left / per_sequence)"}, name="_rounds_up",
                    names={"math": math}, doc="math.ceil where floor was meant: one sequence more than fits.")

_ignores_model_states = edited(
    max_batch, {"left = device_bytes - 16 * psi": "left = device_bytes"}, name="_ignores_model_states",
    doc="""The whole device given to activations, as if the weights, gradients and Adam's
    states took no room (the paper's point in Sec 3: they take 24 GB for GPT-2 1.5B).""")

_fp32_activations = edited(
    max_batch, {"layers * 2": "layers * 4"}, name="_fp32_activations",
    doc="Activations counted as 4-byte values, although mixed precision keeps them in 2 bytes.")


register(Exercise(
    "00.max_batch", "The largest batch that fits beside the model states",
    max_batch, _max_batch_trial,
    {"rounds_up": Bug(_rounds_up, "ceil for floor", "more than the device's"),
     "ignores_model_states": Bug(_ignores_model_states, "the whole device counted for activations",
                                 "the model states come first"),
     "fp32_activations": Bug(_fp32_activations, "activations counted in fp32", "2-byte values")},
    world_sizes=()))
