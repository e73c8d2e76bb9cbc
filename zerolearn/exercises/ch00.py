"""Chapter 00's exercises: where training memory goes (paper Sec 3), in this process.

* ``00.model_state_bytes``: the bytes of parameters, gradients and optimizer states of
  one replica, (2 + 2 + K) Psi in mixed precision (Sec 3.1), for Adam and SGD, in
  fp32, bf16 and fp16;
* ``00.max_batch``: the largest batch whose activations (Sec 3.2) fit beside the
  model states on one device.

Both are checked over a grid of cases against :mod:`zerolearn.memory.model`, and a
message names the case, the quantity and what the paper's accounting gives.
"""

from __future__ import annotations

import math

from zerolearn.exercises.core import Bug, Exercise, Wrong, register
from zerolearn.memory import model as analytic

# ----- 00.model_state_bytes --------------------------------------------------------------

OPTIMIZERS = {"adam": ("adam", True), "sgd_momentum": ("sgd", True), "sgd": ("sgd", False)}
DTYPES = ("bf16", "fp16", "fp32")
PSIS = (134_912, 1_500_000_000, 7_500_000_000)
CATEGORIES = ("params", "grads", "optimizer_states")


def model_state_bytes(psi, optimizer, dtype):
    """Bytes of model states one data-parallel replica holds (paper Sec 3.1).

    Args:
        psi: trainable parameters, an int.
        optimizer: ``"adam"`` (two fp32 moments: momentum and variance),
            ``"sgd_momentum"`` (one fp32 momentum buffer) or ``"sgd"`` (no state).
        dtype: the working dtype of parameters and gradients: ``"fp32"`` (4 bytes),
            ``"bf16"`` or ``"fp16"`` (2 bytes, mixed precision).

    Returns:
        ``{"params": ..., "grads": ..., "optimizer_states": ...}``, ints, in bytes.
        Mixed precision keeps an fp32 master copy of the parameters for the update,
        which the paper counts in the optimizer states' K bytes per parameter;
        in fp32 the working parameters are that copy.
    """
    # BEGIN SOLUTION
    width = 4 if dtype == "fp32" else 2
    master = 0 if dtype == "fp32" else 4
    moments = {"adam": 8, "sgd_momentum": 4, "sgd": 0}[optimizer]
    return {"params": width * psi, "grads": width * psi, "optimizer_states": (master + moments) * psi}
    # END SOLUTION


def _k_explained(optimizer: str, dtype: str) -> str:
    name, momentum = OPTIMIZERS[optimizer]
    k = analytic.optimizer_k(name, dtype, momentum)
    parts = [] if dtype == "fp32" else ["an fp32 master copy (4)"]
    parts += {"adam": ["Adam's momentum (4)", "variance (4)"], "sgd_momentum": ["the momentum buffer (4)"],
              "sgd": []}[optimizer]
    why = " + ".join(parts) if parts else "plain SGD keeps nothing"
    if dtype == "fp32":
        why += "; in fp32 the working parameters are the master copy"
    return f"K = {k}: {why}"


def _explain(category: str, optimizer: str, dtype: str) -> str:
    width = analytic.dtype_bytes(dtype)
    if category == "params":
        return f"{dtype} working parameters take {width} bytes each"
    if category == "grads":
        return f"gradients take the working dtype's {width} bytes ({dtype})"
    return _k_explained(optimizer, dtype)


def _model_state_trial(fn) -> str:
    """Every (dtype, optimizer, Psi) of the grid against ``memory.model.model_state_bytes``
    with ``optimizer_k`` and ``dtype_bytes``."""
    cases = 0
    for dtype in DTYPES:
        for optimizer, (name, momentum) in OPTIMIZERS.items():
            width = analytic.dtype_bytes(dtype)
            want = analytic.model_state_bytes(psi=1, nd=1, stage=0, k=analytic.optimizer_k(name, dtype, momentum),
                                              param_bytes=width, grad_bytes=width)
            for psi in PSIS:
                call = f"model_state_bytes({psi:_}, {optimizer!r}, {dtype!r})"
                got = fn(psi, optimizer, dtype)
                if not isinstance(got, dict) or set(got) != set(CATEGORIES):
                    raise Wrong(f"{call} returned {got!r}; expected a dict with the keys {', '.join(CATEGORIES)}")
                for cat in CATEGORIES:
                    if got[cat] != want[cat] * psi:
                        why = _explain(cat, optimizer, dtype)
                        raise Wrong(f"{call}: your {cat!r} entry is {got[cat]:,} bytes; Sec 3.1 gives "
                                    f"{want[cat] * psi:,} = {want[cat]} bytes x Psi ({why})")
                cases += 1
    return (f"all {cases} cases equal Sec 3.1's accounting: (2 + 2 + K) Psi = 16 Psi for mixed-precision Adam, "
            "(4 + 4 + 8) Psi = 16 Psi in fp32")


def _no_master_copy(psi, optimizer, dtype):
    """K counted as the optimizer's own buffers only (Adam: 8), the fp32 master copy of
    mixed precision forgotten; the commonest undercount of model states."""
    width = 4 if dtype == "fp32" else 2
    moments = {"adam": 8, "sgd_momentum": 4, "sgd": 0}[optimizer]
    return {"params": width * psi, "grads": width * psi, "optimizer_states": moments * psi}


def _master_in_fp32(psi, optimizer, dtype):
    """The master copy counted in fp32 training too, where the working parameters already
    are fp32 (K = 12 for fp32 Adam): the copy exists only in mixed precision."""
    width = 4 if dtype == "fp32" else 2
    moments = {"adam": 8, "sgd_momentum": 4, "sgd": 0}[optimizer]
    return {"params": width * psi, "grads": width * psi, "optimizer_states": (4 + moments) * psi}


def _fp32_grads(psi, optimizer, dtype):
    """Gradients counted in fp32 under mixed precision, as when an implementation keeps fp32
    gradient buffers (Megatron-LM's main_grad); the paper counts 2-byte gradients."""
    width = 4 if dtype == "fp32" else 2
    master = 0 if dtype == "fp32" else 4
    moments = {"adam": 8, "sgd_momentum": 4, "sgd": 0}[optimizer]
    return {"params": width * psi, "grads": 4 * psi, "optimizer_states": (master + moments) * psi}


register(Exercise(
    "00.model_state_bytes", "Model states of one replica: (2 + 2 + K) Psi bytes",
    model_state_bytes, _model_state_trial,
    {"no_master_copy": Bug(_no_master_copy, "K = 8 for mixed-precision Adam", "an fp32 master copy (4)"),
     "master_in_fp32": Bug(_master_in_fp32, "K = 12 for fp32 Adam", "are the master copy"),
     "fp32_grads": Bug(_fp32_grads, "fp32 gradient buffers counted as model states", "working dtype")},
    world_sizes=()))


# ----- 00.max_batch ----------------------------------------------------------------------

def max_batch(psi, device_bytes, hidden, seq_len, layers, checkpointing=False):
    """The largest batch (sequences per step) that fits on one device beside the model states.

    Model states: mixed-precision Adam, 16 bytes per parameter (Sec 3.1). Activations:
    12 x hidden x batch x seq_len x layers values of 2 bytes (Sec 3.2), or with
    ``checkpointing`` (one checkpoint per transformer block) hidden x batch x seq_len
    x layers values. Temporary buffers and fragmentation are left out.

    Args:
        psi: trainable parameters, an int.
        device_bytes: memory of the device in bytes (decimal: 32 GB is 32e9).
        hidden, seq_len, layers: the transformer's width, sequence length and depth, ints.
        checkpointing: whether activations are checkpointed, one per block.

    Returns:
        The largest int ``batch`` >= 0 whose model states plus activations are at
        most ``device_bytes``; 0 when not even the model states fit.
    """
    # BEGIN SOLUTION
    left = device_bytes - 16 * psi
    per_sequence = (1 if checkpointing else 12) * hidden * seq_len * layers * 2
    return max(0, int(left // per_sequence))
    # END SOLUTION


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


def _rounds_up(psi, device_bytes, hidden, seq_len, layers, checkpointing=False):
    """math.ceil where floor was meant: one sequence more than fits."""
    per_sequence = (1 if checkpointing else 12) * hidden * seq_len * layers * 2
    return max(0, math.ceil((device_bytes - 16 * psi) / per_sequence))


def _ignores_model_states(psi, device_bytes, hidden, seq_len, layers, checkpointing=False):
    """The whole device given to activations, as if the weights, gradients and Adam's
    states took no room (the paper's point in Sec 3: they take 24 GB for GPT-2 1.5B)."""
    per_sequence = (1 if checkpointing else 12) * hidden * seq_len * layers * 2
    return int(device_bytes // per_sequence)


def _fp32_activations(psi, device_bytes, hidden, seq_len, layers, checkpointing=False):
    """Activations counted as 4-byte values, although mixed precision keeps them in 2 bytes."""
    per_sequence = (1 if checkpointing else 12) * hidden * seq_len * layers * 4
    return max(0, int((device_bytes - 16 * psi) // per_sequence))


register(Exercise(
    "00.max_batch", "The largest batch that fits beside the model states",
    max_batch, _max_batch_trial,
    {"rounds_up": Bug(_rounds_up, "ceil for floor", "more than the device's"),
     "ignores_model_states": Bug(_ignores_model_states, "the whole device counted for activations",
                                 "the model states come first"),
     "fp32_activations": Bug(_fp32_activations, "activations counted in fp32", "2-byte values")},
    world_sizes=()))
