"""Chapter 06's exercises: the paper's tables turned into functions, in this process.

* ``06.max_psi``: the largest model whose model states fit a device, per stage, with
  model parallelism on top (Table 2's theoretical column, Sec 5);
* ``06.fewest_gpus``: the fewest GPUs, then the lowest stage, that hold a model (the
  rule of ``zerolearn.memory.fit.smallest_fit``).

Both are checked over a grid against :mod:`zerolearn.memory`, Table 2's own rows first.
"""

from __future__ import annotations

import math

from zerolearn.exercises.core import Bug, Exercise, Wrong, register
from zerolearn.memory import fit
from zerolearn.memory import model as analytic

# ----- 06.max_psi ------------------------------------------------------------------------


def max_psi(device_bytes, nd, stage, nm=1, k=12):
    """The largest Psi (parameters) whose model states fit one device (Sec 5, Table 2).

    Mixed precision: 2-byte parameters and gradients, ``k`` bytes of optimizer state per
    parameter (12 for Adam). Model parallelism of degree ``nm`` gives each device Psi / nm
    of the parameters; ZeRO then divides by ``nd`` what the stage partitions: stage 0
    (DP) nothing, 1 (P_os) the optimizer states, 2 (P_os+g) also the gradients, 3
    (P_os+g+p) also the parameters. Activations and buffers are left out, as in
    Table 2's theoretical column.

    Args:
        device_bytes: memory per device in bytes (decimal: 32 GB is 32e9).
        nd: data-parallel degree, an int >= 1.
        stage: 0, 1, 2 or 3.
        nm: model-parallel degree, an int >= 1.
        k: optimizer bytes per parameter.

    Returns:
        The largest Psi, a float (not rounded).
    """
    # BEGIN SOLUTION
    params, grads, states = 2, 2, k  # bytes per parameter, before any partitioning
    if stage >= 1:
        states /= nd
    if stage >= 2:
        grads /= nd
    if stage >= 3:
        params /= nd
    return device_bytes * nm / (params + grads + states)
    # END SOLUTION


PSI_CASES = [(32e9, gpus // mp, stage, mp, 12) for mp, gpus in analytic.TABLE2_THEORETICAL_B for stage in range(4)]
PSI_CASES += [(80e9, 8, stage, 1, 16) for stage in range(4)] + [(40e9, 3, stage, 2, 8) for stage in range(4)]

def _e9(x: float) -> str:
    """A count or a byte size as the paper writes it in code: 32e9, 1.5e9, 10000e9."""
    return f"{x / 1e9:g}e9"


_FORMULA = {0: "(2 + 2 + K)", 1: "(2 + 2 + K / Nd)", 2: "(2 + (2 + K) / Nd)", 3: "(2 + 2 + K) / Nd"}
_DIVIDED = {0: "nothing divided by Nd", 1: "only the optimizer states divided by Nd",
            2: "the gradients and optimizer states divided by Nd", 3: "all three divided by Nd"}


def _max_psi_trial(fn) -> str:
    """Table 2's rows (32 GB, Nd = 64, MP 1 to 16, stages 0-3), then other devices, Nd and
    K, against ``memory.model.max_model_params``."""
    for device, nd, stage, nm, k in PSI_CASES:
        want = analytic.max_model_params(device, nd, stage, k=k, nm=nm)
        call = f"max_psi({_e9(device)}, nd={nd}, stage={stage}, nm={nm}, k={k})"
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


def _one_stage_ahead(device_bytes, nd, stage, nm=1, k=12):
    """Each stage partitions one state too many (P_os taken to shard the gradients as well),
    mixing up the paper's names and DeepSpeed's stage numbers."""
    per = {0: 2 + 2 + k, 1: 2 + (2 + k) / nd, 2: (2 + 2 + k) / nd, 3: (2 + 2 + k) / nd}[stage]
    return device_bytes * nm / per


def _no_model_parallelism(device_bytes, nd, stage, nm=1, k=12):
    """Nm ignored: Table 2's MP column left out, so every row equals the MP = 1 row."""
    per = analytic.model_state_bytes(1, nd, stage, k=k)["total"]
    return device_bytes / per


register(Exercise(
    "06.max_psi", "The largest model a device holds, per stage (Table 2)",
    max_psi, _max_psi_trial,
    {"every_stage_divided": Bug(_every_stage_divided, "DP taken to partition too", "nothing divided by Nd"),
     "one_stage_ahead": Bug(_one_stage_ahead, "stage numbers shifted by one",
                            "only the optimizer states divided by Nd"),
     "no_model_parallelism": Bug(_no_model_parallelism, "Table 2's MP column ignored", "divide by Nm")},
    world_sizes=()))


# ----- 06.fewest_gpus --------------------------------------------------------------------

def fewest_gpus(psi, device_bytes, max_nd=1024):
    """The fewest GPUs, then the lowest ZeRO stage, whose model states hold ``psi`` parameters.

    Model states only, bf16 with Adam: 2 + 2 + K bytes per parameter with K = 12, of
    which stage 1 divides the K by Nd, stage 2 also the gradients' 2, stage 3 all of them
    (Sec 5). Try Nd = 1, 2, ... up to ``max_nd``; at the first Nd where some stage fits
    (bytes per device <= ``device_bytes``), take the lowest such stage: lower stages
    partition less and never move more data (Sec 7).

    Args:
        psi: parameters (a number > 0).
        device_bytes: memory per device in bytes (decimal: 80 GB is 80e9).
        max_nd: the most GPUs to consider, an int >= 1.

    Returns:
        ``(stage, nd)``, two ints, or None when no stage fits on ``max_nd`` GPUs.
    """
    # BEGIN SOLUTION
    for nd in range(1, max_nd + 1):
        for stage, per_param in enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd)):
            if per_param * psi <= device_bytes:
                return stage, nd
    return None
    # END SOLUTION


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
        call = f"fewest_gpus({_e9(psi)}, {_e9(device)})"
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


def _always_stage_3(psi, device_bytes, max_nd=1024):
    """ZeRO-3 whenever it fits, since it holds the least: it moves 1.5x the data of the
    lower stages (Sec 7.2.2) for memory the job did not need."""
    for nd in range(1, max_nd + 1):
        if 16 * psi / nd <= device_bytes:
            return 3, nd
    return None


def _strictly_less(psi, device_bytes, max_nd=1024):
    """``<`` where ``<=`` was meant: a model that fills a device exactly is refused."""
    for nd in range(1, max_nd + 1):
        for stage in range(4):
            if analytic.model_state_bytes(psi, nd, stage)["total"] < device_bytes:
                return stage, nd
    return None


register(Exercise(
    "06.fewest_gpus", "The fewest GPUs, then the lowest stage, that hold a model",
    fewest_gpus, _fewest_trial,
    {"lowest_stage_first": Bug(_lowest_stage_first, "loops over stage, then Nd", "fewest GPUs first"),
     "always_stage_3": Bug(_always_stage_3, "ZeRO-3 whenever it fits", "lowest stage that fits"),
     "strictly_less": Bug(_strictly_less, "< for <=", "which fits (<=)")},
    world_sizes=()))
