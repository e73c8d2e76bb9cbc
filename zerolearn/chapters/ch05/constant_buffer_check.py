"""Exercise ``05.constant_buffer``'s check: ZeRO-R's constant-size fused buffer, CB (paper Sec 6.2).

Average many gradients over the ranks through one fused buffer of a fixed size, fill
after fill, so that no buffer grows with the model. The trial reduces each rank's own
gradients of two MLPs of different sizes (3,095 and 17,201 values) through the same
1,024-element buffer and checks every value against the average over ranks, that the
last, partly filled buffer is reduced too, that each fill overwrites the buffer (a fill
added into it holds the previous fill's values too), one all-reduce per fill of only the
elements it holds, and the memory rule (memory ledger): nothing allocated grows with the model,
and scratch stays within as much again as the buffer.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch05.constant_buffer`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch05.constant_buffer import constant_buffer
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, first_difference, register
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.tables import kib


def _grows_with_model(tensors, buffer, world_size):
    fused = torch.cat([t.view(-1) for t in tensors])  # one buffer as large as the model
    dist.all_reduce(fused)
    fused /= world_size
    offset = 0
    for t in tensors:
        t.view(-1).copy_(fused[offset:offset + t.numel()])
        offset += t.numel()


_drops_tail = edited(constant_buffer, {
    "for lo in range(0, n, size):  # one fill: elements lo ... hi - 1 of the tensors laid end to end":
    "for lo in range(0, n - size + 1, size):  # only full fills: the last, shorter one is never reduced"},
    name="_drops_tail")


BUFFER = 1024  # elements: 4 KiB of fp32
# The memory rule: what the function allocates must not grow with the model (it may differ between the two
# models by SLACK bytes, a few small tensors), and stays within SCRATCH bytes: as much again as the buffer.
SLACK, SCRATCH = 512, 4 * BUFFER
MODELS = {"small": (17, 33, 64, 5), "large": (17, 97, 150, 5)}  # MLP widths: n = 3,095 and 17,201


def _gradients(widths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for fan_in, fan_out in zip(widths, widths[1:], strict=False):  # one layer per pair of neighbours
        out += [torch.randn(fan_out, fan_in, generator=g), torch.randn(fan_out, generator=g)]
    return out


def _compare_values(model: str, grads, want, before, start: torch.Tensor) -> None:
    """The averaged tensors against ``want``; a wrong fill is named by what it holds instead: the
    values as they were (the fill never reduced), or the average plus what the buffer held before
    the fill (``start`` before the first: the values were added into the buffer, not copied)."""
    got, avg, old = (torch.cat([t.reshape(-1) for t in ts]) for ts in (grads, want, before))
    n = got.numel()
    bad = ~torch.isclose(got, avg)
    if bad.any():
        first = int(bad.nonzero()[0])
        fill, fills = first // BUFFER, math.ceil(n / BUFFER)
        lo, hi = fill * BUFFER, min(n, (fill + 1) * BUFFER)
        if torch.isclose(got[first:], old[first:]).all():
            which = ("the last, partly filled buffer must be reduced too" if fill == fills - 1 else
                     f"every fill must be reduced and copied back (fills {fill + 1} to {fills} of {fills})")
            raise Wrong(f"the {model} model's values from element {first:,} of {n:,} on were not averaged: {which}")
        held = start[:hi - lo] if fill == 0 else got[lo - BUFFER:hi - BUFFER]
        if torch.allclose(got[lo:hi], avg[lo:hi] + held, rtol=1e-4, atol=1e-5):
            raise Wrong(f"the {model} model's fill {fill + 1} of {fills} (elements {lo:,} to {hi - 1:,}) came back "
                        "as their average plus what the buffer held before that fill: your code adds the values "
                        "into the buffer (+= or add_) instead of overwriting it; copy each run in with copy_")
    offset = 0
    for k, (g, w) in enumerate(zip(grads, want, strict=True)):
        first_difference(f"the {model} model's tensor {k} (shape {tuple(g.shape)}, elements {offset:,} on)", g, w,
                         reference="the average over ranks")
        offset += g.numel()


def _buffer_trial(fn) -> str:
    """Each rank's own gradients of two MLPs averaged through one 1,024-element buffer."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    buffer = torch.zeros(BUFFER)
    peaks, sizes = {}, {}
    for model, widths in MODELS.items():
        grads, before = _gradients(widths, rank), _gradients(widths, rank)
        want = [sum(ts) / ws for ts in zip(*(_gradients(widths, r) for r in range(ws)), strict=True)]
        n = sizes[model] = sum(t.numel() for t in grads)
        start = buffer.clone()
        comm.LEDGER.reset()
        with MemoryLedger(record_timeline=False) as ledger:
            fn(grads, buffer, ws)
        peaks[model] = ledger.peak
        _compare_values(model, grads, want, before, start)
        reduced = comm.LEDGER.as_dict()["all_reduce"]
        calls, elements = reduced["calls"], reduced["elements"]
        fills = math.ceil(n / BUFFER)
        if peaks[model] <= SCRATCH and calls != fills:
            raise Wrong(f"your function made {calls} all-reduce calls for the {model} model's {n:,} values; "
                        f"{BUFFER:,} at a time takes {fills}")
        if peaks[model] <= SCRATCH and elements != n:
            last = n - (fills - 1) * BUFFER
            raise Wrong(f"your all-reduces moved {elements:,} elements for the {model} model's {n:,} values: "
                        f"{elements - n:,} more than it has; reduce only the filled part of the buffer "
                        f"(buffer[:{last}] for the last fill of {last:,}), not the whole {BUFFER:,}")
    grown = peaks["large"] - peaks["small"]
    figures = (f"your function allocated {kib(peaks['small'], unit=True)} for the small model "
               f"({sizes['small']:,} values) and {kib(peaks['large'], unit=True)} for the large one "
               f"({sizes['large']:,})")
    if grown > SLACK:
        raise Wrong(f"{figures}: {kib(grown, unit=True)} more for {sizes['large'] - sizes['small']:,} more "
                    "values, memory that grows with the model; CB allocates nothing whose size grows with the "
                    f"model: the fused buffer stays {kib(4 * BUFFER, unit=True)} whatever its size (Sec 6.2)")
    if max(peaks.values()) > SCRATCH + SLACK:
        raise Wrong(f"{figures}: it does not grow with the model, but it is more than the "
                    f"{kib(SCRATCH, unit=True)} of scratch CB allows besides the fused buffer (as much again as "
                    f"the buffer's {kib(4 * BUFFER, unit=True)}): fill the buffer you were given, not a new one")
    return (f"two models of {sizes['small']:,} and {sizes['large']:,} values averaged exactly through one "
            f"{kib(4 * BUFFER, unit=True)} buffer, nothing else allocated")


_adds_into_buffer = edited(constant_buffer, {"fused.copy_(part)": "fused.add_(part)"}, name="_adds_into_buffer")

_whole_last_fill = edited(constant_buffer, {"        dist.all_reduce(buffer[:hi - lo])\n        buffer[:hi - lo].div_(":
                                            "        dist.all_reduce(buffer)\n        buffer.div_("},
                          name="_whole_last_fill")

_keeps_every_fill = edited(constant_buffer, {
    "    flats = [t.view(-1) for t in tensors]\n": "    keep = []\n    flats = [t.view(-1) for t in tensors]\n",
    "        buffer[:hi - lo].div_(world_size)\n": "        buffer[:hi - lo].div_(world_size)\n"
                                                 "        keep.append(buffer.clone())\n"}, name="_keeps_every_fill")

_big_staging = edited(constant_buffer, {
    "    flats = [t.view(-1) for t in tensors]\n": "    extra = torch.empty(16 * BUFFER)  # held for the whole call\n"
                                                 "    flats = [t.view(-1) for t in tensors]\n"},
    name="_big_staging", names={"torch": torch, "BUFFER": BUFFER})


register(Exercise(
    "05.constant_buffer", "CB: average gradients through one fused buffer of constant size",
    constant_buffer, _buffer_trial,
    {"grows_with_model": Bug(_grows_with_model, "fusing every gradient into one buffer before the all-reduce, as "
                             "Sec 6.2 says Megatron-LM and DP implementations did (12 GB for 3B parameters)",
                             "grows with the model"),
     "drops_tail": Bug(_drops_tail, "a fill loop over whole buffers only (range(0, n - B + 1, B)): the "
                       "shorter last fill is never reduced", "were not averaged"),
     "adds_into_buffer": Bug(_adds_into_buffer, "each run added into the buffer (add_) instead of copied: from the "
                             "second fill on, the previous fill's values travel too", "instead of overwriting it"),
     "whole_last_fill": Bug(_whole_last_fill, "all_reduce(buffer) at every fill: the short last fill's stale "
                            "tail travels too (right values, more traffic)", "more than it has"),
     "keeps_every_fill": Bug(_keeps_every_fill, "a copy of every fill kept (for a later copy-back, a log): "
                             "one buffer per fill, as many as the model has", "grows with the model"),
     "big_staging": Bug(_big_staging, "a staging tensor of its own, 16 times the fused buffer", "scratch CB allows")},
    stepped=False))
