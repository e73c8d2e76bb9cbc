"""Exercise ``00.model_state_bytes``'s check: the model states of one replica (paper Sec 3.1).

The bytes of parameters, gradients and optimizer states one data-parallel replica
holds, (2 + 2 + K) Psi in mixed precision, for Adam and SGD, in fp32, bf16 and fp16, in
this process. The trial calls the reader's function over a grid of cases and compares
with :mod:`zerolearn.memory.model`; a message names the case, the quantity and what the
paper's accounting gives.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch00.model_state_bytes`.
"""

from __future__ import annotations

import functools

from zerolearn.chapters.ch00.model_state_bytes import model_state_bytes
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.memory import model as analytic

OPTIMIZERS = {"adam": ("adam", True), "sgd_momentum": ("sgd", True), "sgd": ("sgd", False)}
DTYPES = ("bf16", "fp16", "fp32")
SIZES = (1_500_000_000, 7_500_000_000)  # the paper's 1.5B (Sec 3.1) and 7.5B (Fig 1) models


@functools.cache
def psis() -> tuple[int, ...]:
    """The sizes the trial asks about: Psi of the chapter's GPT (the exercises' ``GPT``, counted
    from its tensors), then :data:`SIZES`."""
    from zerolearn.exercises.helpers import GPT
    from zerolearn.models import build_model

    model = build_model("gpt", seed=0, gpt=GPT)
    return (sum(p.numel() for p in model.parameters() if p.requires_grad), *SIZES)
CATEGORIES = ("params", "grads", "optimizer_states")


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
            for psi in psis():
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


_no_master_copy = edited(
    model_state_bytes, {"(master + moments) * psi": "moments * psi"}, name="_no_master_copy",
    doc="""K counted as the optimizer's own buffers only (Adam: 8), the fp32 master copy of
    mixed precision forgotten; the commonest undercount of model states.""")

_master_in_fp32 = edited(
    model_state_bytes, {'master = 0 if dtype == "fp32" else 4': "master = 4"}, name="_master_in_fp32",
    doc="""The master copy counted in fp32 training too, where the working parameters already
    are fp32 (K = 12 for fp32 Adam): the copy exists only in mixed precision.""")

_fp32_grads = edited(
    model_state_bytes, {'"grads": width * psi': '"grads": 4 * psi'}, name="_fp32_grads",
    doc="""Gradients counted in fp32 under mixed precision, as when an implementation keeps fp32
    gradient buffers (Megatron-LM's main_grad); the paper counts 2-byte gradients.""")


register(Exercise(
    "00.model_state_bytes", "Model states of one replica: (2 + 2 + K) Psi bytes",
    model_state_bytes, _model_state_trial,
    {"no_master_copy": Bug(_no_master_copy, "K = 8 for mixed-precision Adam", "an fp32 master copy (4)"),
     "master_in_fp32": Bug(_master_in_fp32, "K = 12 for fp32 Adam", "are the master copy"),
     "fp32_grads": Bug(_fp32_grads, "fp32 gradient buffers counted as model states", "working dtype")},
    world_sizes=()))

