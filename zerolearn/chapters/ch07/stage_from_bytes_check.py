"""Exercise ``07.stage_from_bytes``'s check: which ZeRO stage a rank runs, read from its bytes (paper Sec 5.1-5.3).

Which stage an implementation runs, read from the bytes one of its ranks holds beside a
full replica's (how the chapter tells what DDP, ZeroRedundancyOptimizer and FSDP2
shard), in this process. The trial checks cases built from :mod:`zerolearn.memory`
(padded and whole-tensor shards included, and combinations no stage makes); a message
names the case and the state that decides it.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch07.stage_from_bytes`.
"""

from __future__ import annotations

from zerolearn.chapters.ch07.stage_from_bytes import stage_from_bytes
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.memory import model as analytic

CATEGORIES = ("params", "grads", "optimizer_states")


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


_half_or_less = edited(
    stage_from_bytes, {"held[c] < full[c] for": "held[c] <= full[c] / 2 for"}, name="_half_or_less",
    doc="""A state counted as partitioned only when the rank holds at most half of it (as if
    every shard were 1/Nd): whole-tensor shards, which leave one rank most of a state,
    then read as unpartitioned.""")


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

