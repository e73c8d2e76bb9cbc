"""Exercise ``07.choose_stage``'s check: the lowest stage that fits, residual states included (paper Sec 3.2, 5).

The lowest stage whose model states fit the GPUs you have once the residual states
(activations, buffers; Sec 3.2) are budgeted, in this process. The trial checks GPT-2
1.5B with and without its residual states and 7B to 70B models on 40 and 80 GB GPUs
against :func:`zerolearn.memory.model.model_state_bytes`; a message names the case and
what each stage needs per GPU.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch07.choose_stage`.
"""

from __future__ import annotations

from zerolearn.chapters.ch07.choose_stage import choose_stage
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.memory import fit
from zerolearn.memory import model as analytic


def _gpt2_residual() -> int:
    """Residual bytes per GPU of GPT-2 1.5B at 32 sequences of 1024 tokens, checkpointed
    (activations, one block's recomputation, the fused fp32 gradient buffer; Sec 3.2)."""
    spec = fit.ActivationSpec(hidden=1600, layers=48, batch_per_gpu=32, seq_len=1024, checkpointing=True)
    got = fit.per_device_bytes(fit.gpt_params(48, 1600), 1, 0, activation=spec)
    return int(got["activations"] + got["recompute"] + got["temporary_buffers"])


def _choose_cases() -> list[tuple[float, float, int, int]]:
    gpt2 = fit.gpt_params(48, 1600)
    return [(gpt2, 32e9, 1, 0), (1.5e9, 32e9, 2, 19.5e9), (gpt2, 32e9, 2, _gpt2_residual()), (7e9, 80e9, 2, 0),
            (7e9, 80e9, 8, 4e9),
            (13e9, 40e9, 8, 5e9), (70e9, 80e9, 16, 0), (70e9, 80e9, 8, 0), (7e9, 80e9, 1, 0)]


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _choose_trial(fn) -> str:
    """GPT-2 1.5B with and without its residual states, a model whose residual states
    decide between stages 0, 1 and 3, and 7B to 70B models on 40 and 80 GB GPUs, against
    ``memory.model.model_state_bytes``."""
    for psi, device, nd, residual in _choose_cases():
        need = {s: analytic.model_state_bytes(psi, nd, s)["total"] + residual for s in range(4)}
        want = next((s for s in range(4) if need[s] <= device), None)
        call = f"choose_stage({psi:_.0f}, {device:_.0f}, nd={nd}, residual_bytes={residual:_.0f})"
        got = fn(psi, device, nd, residual)
        if got == want:
            continue
        per_gpu = {s: (f"stage {s} needs {_gb(need[s] - residual)} of model states + {_gb(residual)} of "
                       f"residual states = {_gb(need[s])} per GPU") if residual else
                   f"stage {s} needs {_gb(need[s])} of model states per GPU" for s in range(4)}
        if want is None:
            raise Wrong(f"{call}: you say {got!r}; no stage fits: {per_gpu[3]}, more than {_gb(device)}: "
                        "return None")
        if got not in range(4):
            raise Wrong(f"{call} returned {got!r}; expected a stage 0-3 or None: {per_gpu[want]}")
        if need[got] > device:
            divided = next((s for s in range(4) if need[s] - residual + residual / nd <= device), None)
            why = ("residual states are not divided by Nd" if got == divided else
                   "the residual states count on every GPU, besides the model states")
            raise Wrong(f"{call}: you say stage {got}, but {per_gpu[got]}, more than the GPU's {_gb(device)}; "
                        f"{why}")
        raise Wrong(f"{call}: you say stage {got}; stage {want} fits ({per_gpu[want]}) and moves no more data "
                    "than a higher stage: take the lowest stage that fits")
    return f"all {len(_choose_cases())} cases right"


_ignores_residual = edited(
    choose_stage, {"per_param * psi + residual_bytes <=": "per_param * psi <="}, name="_ignores_residual",
    doc="""Model states alone, the residual states left out: the pitfall of Sec 3.2 (and of
    chapter 7), an estimate that fits where the training step does not.""")

_highest_that_fits = edited(
    choose_stage, {"enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd))":
                   "((3, 16 / nd), (2, 2 + 14 / nd), (1, 4 + 12 / nd), (0, 16))"}, name="_highest_that_fits",
    doc="""ZeRO-3 first, since it holds the least, and lower stages only when it does not fit:
    1.5x the traffic (Sec 7.2.2) for memory the job did not need.""")

_residual_divided = edited(
    choose_stage, {"+ residual_bytes <=": "+ residual_bytes / nd <="}, name="_residual_divided",
    doc="""Residual states divided by Nd like partitioned model states; ZeRO-DP does not
    divide activations (P_a, Sec 6.1, divides them by the model-parallel degree).""")


register(Exercise(
    "07.choose_stage", "The lowest stage that fits your GPUs, residual states included",
    choose_stage, _choose_trial,
    {"ignores_residual": Bug(_ignores_residual, "model states alone (Sec 3.2)", "count on every GPU"),
     "highest_that_fits": Bug(_highest_that_fits, "ZeRO-3 first", "take the lowest stage that fits"),
     "residual_divided": Bug(_residual_divided, "activations divided by Nd", "not divided by Nd")},
    world_sizes=()))
