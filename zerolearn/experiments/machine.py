"""What teaches on the machine at hand: how many ranks, on which backend and device.

ZeRO only shows with several ranks: at world size 1 every stage holds every byte. A
machine with fewer GPUs than the ranks a lesson needs (one GPU, say) cannot run them
on NCCL, which puts one rank on one GPU. The tour and the chapter scripts then run gloo
ranks on the CPU; the seed experiment, whose full width does not fit a laptop's memory
many times over, runs a simulated world on the one GPU (``--simulate-world-size``: every
shard and buffer the size it has on N ranks). Each plan carries one line that says what
was chosen and why, for the reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerolearn.errors import ConfigError

TOUR_RANKS = 4
"""Ranks the tour shows when the machine has fewer GPUs than that (gloo, on the CPU)."""
SEED_RANKS = 2
"""Ranks of the blog's seed experiment (2 GPUs)."""


@dataclass(frozen=True)
class RankPlan:
    """How a job's ranks run here.

    Attributes:
        world_size: ranks (simulated ones included).
        backend: "gloo", "nccl", or "fake" (a simulated world in one process).
        device: "cpu" or "cuda".
        simulated: True when one process plays ``world_size`` ranks (torch's fake backend).
        note: one line for the reader: what runs, and why on this machine.
    """

    world_size: int
    backend: str
    device: str
    simulated: bool
    note: str


def gpus() -> int:
    """GPUs torch can use here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_world(name: str, world_size: int | None) -> None:
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ConfigError(f"{name} {world_size!r}: must be an integer >= 1")


def plan_tour(world_size: int | None = None, backend: str | None = None) -> RankPlan:
    """The tour's ranks: NCCL on every GPU when there are at least two (or ``world_size``
    of them); with fewer GPUs than ranks, :data:`TOUR_RANKS` (or ``world_size``) gloo
    ranks on the CPU. ``backend="nccl"`` asks for NCCL whatever the count (world size 1
    on one GPU: every stage then holds every byte).

    Raises:
        ConfigError: ``world_size`` not an integer >= 1, ``backend`` not None, "gloo" or
            "nccl", or NCCL without CUDA.
    """
    _check_world("--world-size", world_size)
    if backend not in (None, "gloo", "nccl"):
        raise ConfigError(f"--backend {backend!r}: allowed are gloo, nccl")
    n = gpus()
    if backend == "nccl":
        if n == 0:
            raise ConfigError("--backend nccl: CUDA is not available on this machine; use gloo")
        world = world_size or n
        return RankPlan(world, "nccl", "cuda", False, f"{world} NCCL rank(s) on {n} GPU(s), as asked")
    if backend is None and n >= 2 and (world_size or n) <= n:
        world = world_size or n
        return RankPlan(world, "nccl", "cuda", False, f"{world} NCCL ranks, one per GPU")
    world = world_size or TOUR_RANKS
    if backend == "gloo":
        return RankPlan(world, "gloo", "cpu", False, f"{world} gloo ranks on the CPU, as asked")
    why = "no GPU here" if n == 0 else f"{n} GPU here, fewer than the {world} ranks ZeRO needs to show its partitions"
    hint = "; --backend nccl --world-size 1 runs one NCCL rank on the GPU" if n == 1 else ""
    return RankPlan(world, "gloo", "cpu", False, f"{world} gloo ranks on the CPU: {why}{hint}")


def plan_seed(world_size: int | None = None, simulate_world_size: int | None = None,
              under_torchrun: bool = False) -> RankPlan:
    """The seed experiment's ranks: under torchrun, its ranks; ``simulate_world_size``:
    a simulated world (on the GPU when there is one); else :data:`SEED_RANKS` (or
    ``world_size``) NCCL ranks when there are that many GPUs, a simulated world of that
    size on the one GPU when there are fewer, gloo ranks on the CPU without CUDA.

    Raises:
        ConfigError: a world size not an integer >= 1.
    """
    _check_world("--world-size", world_size)
    _check_world("--simulate-world-size", simulate_world_size)
    n = gpus()
    device = "cuda" if n else "cpu"
    if under_torchrun:
        return RankPlan(world_size or 0, "auto", device, False, "the ranks torchrun started")
    if simulate_world_size:
        return RankPlan(simulate_world_size, "fake", device, True,
                        f"{simulate_world_size} simulated ranks in one process on the {device.upper()}, as asked")
    world = world_size or SEED_RANKS
    if n >= world:
        return RankPlan(world, "nccl", "cuda", False, f"{world} NCCL ranks, one per GPU")
    if n:
        return RankPlan(world, "fake", "cuda", True,
                        f"{world} simulated ranks on the GPU ({n} GPU here, fewer than {world}): every shard and "
                        f"buffer the size it has on {world} ranks; collectives move no data")
    return RankPlan(world, "gloo", "cpu", False, f"{world} gloo ranks on the CPU (no GPU here)")


def plan_chapter(local_world_size: int, backend: str = "auto", device: str = "auto") -> tuple[str, str, str | None]:
    """(backend, device, note) for a chapter script's ``local_world_size`` ranks on this
    node: with ``auto`` and fewer GPUs than ranks, gloo on the CPU (NCCL cannot put two
    ranks on one GPU), with a note that says so; otherwise what was asked (note None).

    Raises:
        ConfigError: ``local_world_size`` not an integer >= 1.
    """
    _check_world("--nproc-per-node", local_world_size)
    n = gpus()
    if backend == "auto" and device == "auto" and 0 < n < local_world_size:
        return "gloo", "cpu", (f"{local_world_size} ranks, {n} GPU(s) on this node: gloo ranks on the CPU "
                               "(NCCL puts one rank on one GPU)")
    return backend, device, None
