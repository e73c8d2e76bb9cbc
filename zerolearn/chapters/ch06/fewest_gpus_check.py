"""Exercise ``06.fewest_gpus``'s check: the fewest GPUs, then the lowest stage, that hold a model (paper Sec 5, 7).

The rule of :func:`zerolearn.memory.fit.smallest_fit`, in this process. The trial checks
models from 1.5B to 10T parameters on 32 to 141 GB devices (one of them filled exactly)
against it, and a message names the case and the stage that fits.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch06.fewest_gpus`.
"""

from __future__ import annotations

from zerolearn.chapters.ch06.fewest_gpus import fewest_gpus
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.exercises.helpers import e9
from zerolearn.memory import fit
from zerolearn.memory import model as analytic

GPU_CASES = ((7e9, 80e9), (13e9, 40e9), (7e9, 70e9), (1.5e9, 32e9), (70e9, 80e9), (175e9, 141e9), (1e12, 32e9),
             (1e13, 32e9))


def _per_device(psi: float, nd: int, stage: int) -> float:
    return analytic.model_state_bytes(psi, nd, stage)["total"]


def _fewest_trial(fn) -> str:
    """Models from 1.5B to 10T parameters on 32 to 141 GB devices (one of them filled
    exactly) against ``memory.fit.smallest_fit``."""
    for psi, device in GPU_CASES:
        best = fit.smallest_fit(psi, device)
        want = None if best is None else (best.stage, best.nd)
        call = f"fewest_gpus({e9(psi)}, {e9(device)})"
        got = fn(psi, device)
        got = tuple(got) if isinstance(got, list) else got
        if got == want:
            continue
        if want is None:
            raise Wrong(f"{call}: you say {got!r}; no stage fits on {fit.DEFAULT_MAX_ND} GPUs "
                        f"(stage 3 needs {_per_device(psi, fit.DEFAULT_MAX_ND, 3) / 1e9:,.1f} GB each): return None")
        stage, nd = want
        need = _per_device(psi, nd, stage)
        fits = f"stage {stage} on {nd} GPUs holds {need / 1e9:,.1f} GB each" + (
            ", exactly the device's memory, which fits (<=)" if need == device else f", within {device / 1e9:g} GB")
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, int) for v in got)):
            raise Wrong(f"{call} returned {got!r}; expected (stage, nd), two ints: {fits}")
        g_stage, g_nd = got
        if g_stage not in range(4) or g_nd < 1 or _per_device(psi, g_nd, g_stage) > device:
            over = "" if g_stage not in range(4) or g_nd < 1 else \
                f" holds {_per_device(psi, g_nd, g_stage) / 1e9:,.1f} GB each, more than {device / 1e9:g} GB"
            raise Wrong(f"{call}: you say stage {g_stage} on {g_nd} GPUs, which{over or ' is not a setup'}; {fits}")
        if g_nd > nd:
            raise Wrong(f"{call}: you say stage {g_stage} on {g_nd} GPUs; {fits}: the rule takes the fewest GPUs "
                        "first, then the lowest stage")
        raise Wrong(f"{call}: you say stage {g_stage} on {g_nd} GPUs; {fits}: take the lowest stage that fits, "
                    "since a higher stage partitions more and never moves less data (Sec 7)")
    return (f"all {len(GPU_CASES)} models right; 7B on 80 GB GPUs: stage {fn(7e9, 80e9)[0]} on "
            f"{fn(7e9, 80e9)[1]} GPUs")


def _lowest_stage_first(psi, device_bytes, max_nd=1024):
    """The loops nested the other way: the lowest stage that fits at any Nd, then its
    fewest GPUs; 13B on 40 GB GPUs becomes stage 2 on 13 GPUs where stage 3 needs 6."""
    for stage in range(4):
        for nd in range(1, max_nd + 1):
            if analytic.model_state_bytes(psi, nd, stage)["total"] <= device_bytes:
                return stage, nd
    return None


_always_stage_3 = edited(
    fewest_gpus, {"enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd))": "((3, 16 / nd),)"}, name="_always_stage_3",
    doc="""ZeRO-3 whenever it fits, since it holds the least: it moves 1.5x the data of the
    lower stages (Sec 7.2.2) for memory the job did not need.""")

_strictly_less = edited(
    fewest_gpus, {"per_param * psi <= device_bytes": "per_param * psi < device_bytes"}, name="_strictly_less",
    doc="``<`` where ``<=`` was meant: a model that fills a device exactly is refused.")


register(Exercise(
    "06.fewest_gpus", "The fewest GPUs, then the lowest stage, that hold a model",
    fewest_gpus, _fewest_trial,
    {"lowest_stage_first": Bug(_lowest_stage_first, "loops over stage, then Nd", "fewest GPUs first"),
     "always_stage_3": Bug(_always_stage_3, "ZeRO-3 whenever it fits", "lowest stage that fits"),
     "strictly_less": Bug(_strictly_less, "< for <=", "which fits (<=)")},
    world_sizes=()))
