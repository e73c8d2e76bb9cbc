"""Chapter 07's exercises: choosing and recognising a stage in practice, in this process.

* ``07.stage_from_bytes``: which ZeRO stage an implementation runs, read from the
  bytes one of its ranks holds beside a full replica's (how the chapter tells what
  DDP, ZeroRedundancyOptimizer and FSDP2 shard);
* ``07.choose_stage``: the lowest stage whose model states fit the GPUs you have once
  the residual states (activations, buffers; Sec 3.2) are budgeted.

Checked over cases built from :mod:`zerolearn.memory` (padded and whole-tensor shards
included), with messages that name the case and the state that decides it.
"""

from __future__ import annotations

from zerolearn.exercises.core import Bug, Exercise, Wrong, register
from zerolearn.memory import fit
from zerolearn.memory import model as analytic

CATEGORIES = ("params", "grads", "optimizer_states")

# ----- 07.stage_from_bytes ---------------------------------------------------------------


def stage_from_bytes(held, full):
    """The ZeRO stage (0-3) a rank runs, read from the model-state bytes it holds.

    A state is partitioned when the rank holds less of it than a full replica does,
    however unequal the shards (``ZeroRedundancyOptimizer`` gives whole tensors to
    ranks, so one rank may hold most of it). Stage 0 partitions nothing, 1 the
    optimizer states, 2 also the gradients, 3 also the parameters (Sec 5.1-5.3).

    Args:
        held: ``{"params": ..., "grads": ..., "optimizer_states": ...}``, bytes one rank holds.
        full: the same three, in bytes, for one unpartitioned replica (what DP holds).

    Returns:
        The stage, an int 0-3.

    Raises:
        ValueError: the partitioned states match no stage (e.g. gradients partitioned,
            optimizer states whole).
    """
    # BEGIN SOLUTION
    parted = tuple(held[c] < full[c] for c in ("optimizer_states", "grads", "params"))
    stages = {(False, False, False): 0, (True, False, False): 1, (True, True, False): 2, (True, True, True): 3}
    if parted not in stages:
        raise ValueError(f"no ZeRO stage partitions exactly these states: {held} of {full}")
    return stages[parted]
    # END SOLUTION


def _stage_cases() -> list[tuple[str, dict, dict, int | None]]:
    """(what, held, full, stage or None for 'no stage') from the memory model with padding,
    then whole-tensor shards as torch's ZeroRedundancyOptimizer makes them, then
    combinations no stage makes."""
    psi, width, k = 134_912, 4, 8  # chapter 7's GPT, fp32 Adam
    full = {c: v for c, v in analytic.model_state_bytes(psi, 1, 0, k=k, param_bytes=width, grad_bytes=width).items()
            if c != "total"}
    cases = []
    for nd in (2, 3, 4):
        pad = -psi % nd
        for stage in range(4):
            held = analytic.model_state_bytes(psi + pad, nd, stage, k=k, param_bytes=width, grad_bytes=width)
            held = {c: held[c] if held[c] < full[c] else full[c] for c in CATEGORIES}
            cases.append((f"stage {stage} on {nd} ranks ({pad} padding elements)", held, full, stage))
    cases.append(("ZeroRedundancyOptimizer on 2 ranks, rank 0 owning the larger whole tensors",
                  {**full, "optimizer_states": int(full["optimizer_states"] * 0.61)}, full, 1))
    cases.append(("FSDP2 on 3 ranks, rank 0 with the largest shard",
                  {c: int(full[c] * 0.52) for c in CATEGORIES}, full, 3))
    cases.append(("gradients partitioned, optimizer states whole", {**full, "grads": full["grads"] // 2}, full, None))
    cases.append(("parameters partitioned, the rest whole", {**full, "params": full["params"] // 2}, full, None))
    return cases


def _stage_trial(fn) -> str:
    """Each stage at Nd = 2, 3, 4 with padded flat shards, uneven whole-tensor shards, and
    two combinations that no stage makes (ValueError expected)."""
    cases = _stage_cases()
    for what, held, full, want in cases:
        shares = ", ".join(f"{c} {held[c] / full[c]:.0%}" for c in CATEGORIES)
        try:
            got = fn(dict(held), dict(full))
        except ValueError:
            if want is None:
                continue
            raise Wrong(f"{what} (the rank holds {shares} of a replica): you raised ValueError; it is stage "
                        f"{want}") from None
        if want is None:
            raise Wrong(f"{what} (the rank holds {shares} of a replica): you say stage {got!r}; no stage does "
                        "that (each stage partitions what the one before did, plus one more state: optimizer "
                        "states, then gradients, then parameters): raise ValueError")
        if got != want:
            why = ("a rank that holds less than a full copy holds a shard, however uneven"
                   if any(0.5 < held[c] / full[c] < 1 for c in CATEGORIES) else
                   f"partitioned are: {', '.join(c for c in CATEGORIES if held[c] < full[c]) or 'nothing'}")
            raise Wrong(f"{what} (the rank holds {shares} of a replica): you say stage {got!r}; it is stage "
                        f"{want}: {why}")
    return f"all {len(cases)} cases right, uneven shards and impossible combinations included"


def _half_or_less(held, full):
    """A state counted as partitioned only when the rank holds at most half of it (as if
    every shard were 1/Nd): whole-tensor shards, which leave one rank most of a state,
    then read as unpartitioned."""
    parted = tuple(held[c] <= full[c] / 2 for c in ("optimizer_states", "grads", "params"))
    stages = {(False, False, False): 0, (True, False, False): 1, (True, True, False): 2, (True, True, True): 3}
    if parted not in stages:
        raise ValueError("no stage")
    return stages[parted]


def _count_partitioned(held, full):
    """The number of partitioned states taken for the stage, whichever they are: a rank
    that partitions only its gradients reads as stage 1 instead of an error."""
    return sum(held[c] < full[c] for c in CATEGORIES)


register(Exercise(
    "07.stage_from_bytes", "Which stage does it run? Read it from the bytes a rank holds",
    stage_from_bytes, _stage_trial,
    {"half_or_less": Bug(_half_or_less, "a shard taken to be at most 1/2", "however uneven"),
     "count_partitioned": Bug(_count_partitioned, "counting partitioned states", "raise ValueError")},
    world_sizes=()))


# ----- 07.choose_stage -------------------------------------------------------------------

def choose_stage(psi, device_bytes, nd, residual_bytes=0):
    """The lowest ZeRO stage that fits ``psi`` parameters on the ``nd`` GPUs you have.

    Per device: the model states of the stage (bf16 and Adam: 2 + 2 + K bytes per
    parameter with K = 12, of which stage 1 divides the K by ``nd``, stage 2 also the
    gradients' 2, stage 3 all of them; Sec 5) plus ``residual_bytes`` (activations,
    temporary buffers: ZeRO-DP does not divide them, Sec 3.2). The lowest stage that
    fits moves the least data: stages 1 and 2 move DP's 2 Psi, stage 3 3 Psi (Sec 7).

    Args:
        psi: parameters (a number > 0).
        device_bytes: memory per GPU in bytes (decimal: 32 GB is 32e9).
        nd: the number of GPUs (data-parallel degree), an int >= 1.
        residual_bytes: bytes per GPU besides model states.

    Returns:
        The stage, an int 0-3, or None when no stage fits.
    """
    # BEGIN SOLUTION
    for stage, per_param in enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd)):
        if per_param * psi + residual_bytes <= device_bytes:
            return stage
    return None
    # END SOLUTION


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


def _ignores_residual(psi, device_bytes, nd, residual_bytes=0):
    """Model states alone, the residual states left out: the pitfall of Sec 3.2 (and of
    chapter 7), an estimate that fits where the training step does not."""
    for stage, per_param in enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd)):
        if per_param * psi <= device_bytes:
            return stage
    return None


def _highest_that_fits(psi, device_bytes, nd, residual_bytes=0):
    """ZeRO-3 first, since it holds the least, and lower stages only when it does not fit:
    1.5x the traffic (Sec 7.2.2) for memory the job did not need."""
    for stage, per_param in ((3, 16 / nd), (2, 2 + 14 / nd), (1, 4 + 12 / nd), (0, 16)):
        if per_param * psi + residual_bytes <= device_bytes:
            return stage
    return None


def _residual_divided(psi, device_bytes, nd, residual_bytes=0):
    """Residual states divided by Nd like partitioned model states; ZeRO-DP does not
    divide activations (P_a, Sec 6.1, divides them by the model-parallel degree)."""
    for stage, per_param in enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd)):
        if per_param * psi + residual_bytes / nd <= device_bytes:
            return stage
    return None


register(Exercise(
    "07.choose_stage", "The lowest stage that fits your GPUs, residual states included",
    choose_stage, _choose_trial,
    {"ignores_residual": Bug(_ignores_residual, "model states alone (Sec 3.2)", "count on every GPU"),
     "highest_that_fits": Bug(_highest_that_fits, "ZeRO-3 first", "take the lowest stage that fits"),
     "residual_divided": Bug(_residual_divided, "activations divided by Nd", "not divided by Nd")},
    world_sizes=()))
