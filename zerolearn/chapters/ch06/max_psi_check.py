"""Exercise ``06.max_psi``'s check: the largest model a device holds, per stage (paper Sec 5, Table 2).

The largest model whose model states fit a device, per stage, with model parallelism on
top (Table 2's theoretical column), in this process. The trial checks Table 2's own rows
first, then other devices, Nd and K, against
:func:`zerolearn.memory.model.max_model_params`.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch06.max_psi`.
"""

from __future__ import annotations

import math

from zerolearn.chapters.ch06.max_psi import max_psi
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.exercises.helpers import e9
from zerolearn.memory import model as analytic

PSI_CASES = [(32e9, gpus // mp, stage, mp, 12) for mp, gpus in analytic.TABLE2_THEORETICAL_B for stage in range(4)]
PSI_CASES += [(80e9, 8, stage, 1, 16) for stage in range(4)] + [(40e9, 3, stage, 2, 8) for stage in range(4)]

_FORMULA = {0: "(2 + 2 + K)", 1: "(2 + 2 + K / Nd)", 2: "(2 + (2 + K) / Nd)", 3: "(2 + 2 + K) / Nd"}
_DIVIDED = {0: "nothing divided by Nd", 1: "only the optimizer states divided by Nd",
            2: "the gradients and optimizer states divided by Nd", 3: "all three divided by Nd"}


def _max_psi_trial(fn) -> str:
    """Table 2's rows (32 GB, Nd = 64, MP 1 to 16, stages 0-3), then other devices, Nd and
    K, against ``memory.model.max_model_params``."""
    for device, nd, stage, nm, k in PSI_CASES:
        want = analytic.max_model_params(device, nd, stage, k=k, nm=nm)
        call = f"max_psi({e9(device)}, nd={nd}, stage={stage}, nm={nm}, k={k})"
        got = fn(device, nd, stage, nm, k)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise Wrong(f"{call} returned {got!r}; expected a number of parameters")
        if not math.isclose(got, want, rel_tol=1e-9):
            per = analytic.model_state_bytes(1, nd, stage, k=k)["total"]
            mp = f"; each device holds Psi / Nm of the parameters, so divide by Nm = {nm} too" if nm > 1 else ""
            raise Wrong(f"{call}: you say {got / 1e9:,.3f}B; {want / 1e9:,.3f}B fit: stage {stage} "
                        f"({analytic.STAGE_NAMES[stage]}) holds {_FORMULA[stage]} = {per:g} bytes per parameter, "
                        f"{_DIVIDED[stage]}{mp}")
    row = [fn(32e9, 64, s, 1, 12) / 1e9 for s in range(4)]
    return ("Table 2's theoretical column recomputed; MP = 1, 64 GPUs: "
            + ", ".join(f"{analytic.STAGE_NAMES[s]} {v:,.1f}B" for s, v in enumerate(row)))


def _every_stage_divided(device_bytes, nd, stage, nm=1, k=12):
    """(2 + 2 + K) / Nd for every stage: the stage ignored, as if DP already partitioned."""
    return device_bytes * nm * nd / (4 + k)


_one_stage_ahead = edited(
    max_psi, {"if stage >= 2:": "if stage >= 1:", "if stage >= 3:": "if stage >= 2:"}, name="_one_stage_ahead",
    doc="""Each stage partitions one state too many (P_os taken to shard the gradients as well),
    mixing up the paper's names and DeepSpeed's stage numbers.""")

_no_model_parallelism = edited(
    max_psi, {"device_bytes * nm / (": "device_bytes / ("}, name="_no_model_parallelism",
    doc="Nm ignored: Table 2's MP column left out, so every row equals the MP = 1 row.")


register(Exercise(
    "06.max_psi", "The largest model a device holds, per stage (Table 2)",
    max_psi, _max_psi_trial,
    {"every_stage_divided": Bug(_every_stage_divided, "DP taken to partition too", "nothing divided by Nd"),
     "one_stage_ahead": Bug(_one_stage_ahead, "stage numbers shifted by one",
                            "only the optimizer states divided by Nd"),
     "no_model_parallelism": Bug(_no_model_parallelism, "Table 2's MP column ignored", "divide by Nm")},
    world_sizes=()))

