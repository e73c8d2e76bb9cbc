"""Exercise ``08.quantized_all_gather``'s check: ZeRO++'s qwZ (Wang et al. 2023, arXiv 2306.10209).

The trial runs the reader's function on 2 and then 3 gloo ranks, twice: 150 elements
a rank in blocks of 64 (two whole blocks and a partial one of 22) and in blocks of 50.
Each rank's shard is drawn from a seed of its own and scaled by rank + 1, and its first
50 elements are a thousand times smaller than the rest, so that one scale for the whole
tensor, a forgotten padding or another rank's scales each show. On rank 1, elements 50
to 127 are zeros: a whole block of zeros in blocks of 64 and in blocks of 50, whose
max |x| / 127 is 0, so that a division by that scale (0 / 0, NaN) shows. Casting NaN to
int8 is undefined (this CPU happens to give 0, and 0 times a scale of 0 is the right
value), so the trial watches the reader's casts to an integer type and names one fed a
NaN, with its line, once the values are right.

Every element of ``out`` must lie within half a quantization step of the value the
rank sent: round to nearest errs by at most ``scale / 2`` for that block's scale,
whatever way the division is written. A wrong element is named by its rank, block and
index, and compared with what each known mistake would give, to say which it is.
The all-gathers booked in ``comm.LEDGER`` (torch's collectives, watched by
:func:`zerolearn.watch.watching` while the trial runs) must move at most the bytes of int8
values and one fp32 scale per block (fp32 values would be about 4x as many).

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch08.quantized_all_gather`.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch08.quantized_all_gather import quantized_all_gather
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, machinery, readers_line, register

N = 150
BLOCKS = (64, 50)


ZEROS = (1, slice(50, 128))  # the rank and the elements that are zeros: block 1 in blocks of 64 and of 50


def shard_of(rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard: N fp32 values, its first 50 1000x smaller, scaled by rank + 1; on
    rank 1, elements 50 to 127 zeros (:data:`ZEROS`)."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(800 + rank)) * (rank + 1)
    x[:50] *= 1e-3
    if rank == ZEROS[0]:
        x[ZEROS[1]] = 0.0
    return x


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


class _NaNCasts(TorchDispatchMode):
    """While active, records the reader's line of every cast to an integer type fed a NaN
    (``.to(torch.int8)``, ``.char()``, ``q.copy_(x)``): ``lines``, first first."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    @machinery
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _CASTS and isinstance(out, torch.Tensor) and not out.dtype.is_floating_point and \
                out.dtype != torch.bool:
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if isinstance(source, torch.Tensor) and source.dtype.is_floating_point and bool(source.isnan().any()):
                self.lines.append(readers_line())
        return out


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    nb = -(-x.numel() // block)
    padded = torch.zeros(nb * block)
    padded[:x.numel()] = x
    return padded.view(nb, block)


def _scales(x: torch.Tensor, block: int) -> torch.Tensor:
    s = _blocks(x, block).abs().amax(dim=1) / 127
    return torch.where(s == 0, torch.ones_like(s), s)


def _dequantized(x: torch.Tensor, block: int, scales: torch.Tensor, rounding=torch.round,
                 dequantize_with: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized with ``scales`` (one per block) and ``rounding``, dequantized with
    ``dequantize_with`` (default: the same scales); the first ``x.numel()`` elements."""
    q = rounding(_blocks(x, block) / scales[:, None]).clamp(-127, 127)
    back = scales if dequantize_with is None else dequantize_with
    return (q * back[:, None]).reshape(-1)[:x.numel()]


def _within(got: torch.Tensor, want: torch.Tensor, step: torch.Tensor) -> bool:
    return bool(((got - want).abs() <= step / 2 * (1 + 1e-4) + 1e-12).all())


def _diagnose(part: torch.Tensor, rank: int, world_size: int, block: int) -> str:
    """What a rank's wrong part of ``out`` is, when it is one of the known mistakes."""
    x, own = shard_of(rank), _scales(shard_of(rank), block)
    step = own.repeat_interleave(block)[:N]
    whole = (N // block) * block
    if whole < N and bool((part[whole:] == 0).all()) and _within(part[:whole], x[:whole], step[:whole]):
        return (f"its last {N - whole} elements (a partial block) came back as 0: pad the shard with zeros to "
                f"{-(-N // block)} whole blocks of {block} before quantizing")
    one = x.abs().max() / 127
    if _within(part, _dequantized(x, block, one.repeat(own.numel())), one.expand(N)):
        return (f"it was quantized with one scale for the whole tensor ({one:.3g}): the first 50 elements, 1000x "
                "smaller than the rest, round to nearly nothing. Give every block its own scale, max |x| / 127 over "
                "the block")
    if _within(part, _dequantized(x, block, own, rounding=torch.trunc), step):
        return "its values were rounded toward zero (.to(torch.int8) truncates): round to nearest first (torch.round)"
    for other in range(world_size):
        if other != rank:
            raw = _blocks(shard_of(other), block).abs().amax(dim=1) / 127  # their scales, with or without
            for theirs in (_scales(shard_of(other), block), raw):     # the guard for a block of zeros
                wrong = _dequantized(x, block, own, dequantize_with=theirs)
                if _within(part, wrong, theirs.repeat_interleave(block)[:N]):
                        return (f"rank {rank}'s int8 values were dequantized with rank {other}'s scales: each rank's "
                            "values go with the scales that rank sent")
    return ""


def _check_part(out: torch.Tensor, r: int, world_size: int, block: int, step: int) -> None:
    """Rank ``r``'s part of ``out`` within half a quantization step of what it sent, or Wrong naming why not."""
    part, x = out[r * N:(r + 1) * N], shard_of(r)
    scales = _scales(x, block)
    bound = scales.repeat_interleave(block)[:N] / 2
    err = (part - x).abs()
    bad = ~(err <= bound * (1 + 1e-4) + 1e-12)  # NaN (never written) counts as wrong
    if bad.any():
        i = int(bad.nonzero()[0])
        why = _diagnose(part, r, world_size, block)
        why = f". {why[0].upper()}{why[1:]}" if why else ""
        raise Wrong(f"blocks of {block}: rank {r}'s part of out, element {i} (block {i // block}): you have "
                    f"{part[i].item():.6g}, rank {r} sent {x[i].item():.6g}; rounding to nearest with that "
                    f"block's scale errs by at most {bound[i].item():.3g}{why}", step)


def _qwz_trial(fn) -> str:
    """The reader's function on this rank's shard, in blocks of 64 and of 50; see the module docstring."""
    ctx = zdist.context()
    rank, world_size = ctx.rank, ctx.world_size
    for step, block in enumerate(BLOCKS):
        out = torch.full((world_size * N,), float("nan"))
        comm.LEDGER.reset()
        with _NaNCasts() as casts:
            fn(out, shard_of(rank).clone(), block, world_size)
        gathered = comm.LEDGER.as_dict()["all_gather"]
        nb = -(-N // block)
        if gathered["calls"] == 0:
            raise Wrong("your function made no all-gather: gather the int8 values and the scales with "
                        "dist.all_gather_single(output, input)", step)
        budget = world_size * (nb * block + 4 * nb)
        if gathered["bytes"] > budget:
            raise Wrong(f"blocks of {block}: your all-gathers moved {gathered['bytes']:,} bytes; int8 values and "
                        f"one fp32 scale per block are {budget:,} bytes (fp32 values alone would be "
                        f"{world_size * N * 4:,}): send the int8 values, not the fp32 ones", step)
        for r in range(world_size):
            _check_part(out, r, world_size, block, step)
        if casts.lines:
            zero = f"block {-(-ZEROS[1].start // block)}" if rank == ZEROS[0] else "a block"
            raise Wrong(f"blocks of {block}: rank {rank}'s {zero}, all zeros, got scale max |x| / 127 = 0, and your "
                        f"function cast NaN to int8{casts.lines[0]}: x / scale is 0 / 0 = NaN there, and a cast of "
                        "NaN to an integer is undefined (this CPU gives 0, others need not). Give a block of zeros "
                        "scale 1 (any scale gives q = 0)", step)
        agree(step)
    return ("every element within half a quantization step of the value sent, in blocks of 64 (padded) and 50; "
            "int8 values and fp32 scales all-gathered")


_one_scale = edited(
    quantized_all_gather, {"scales = x.abs().amax(dim=1) / 127": "scales = x.abs().amax().expand(nb) / 127"},
    name="_one_scale",
    doc="""Per-tensor quantization: one absmax scale for the whole shard (the scheme ZeRO++ replaces
    with blocks; a single large value crushes every small one).""")

_no_padding = edited(quantized_all_gather, {
    "nb = -(-n // block)  # ceil: the last block is padded with zeros": "nb = n // block  # the whole blocks only",
    "x[:n] = shard": "x[:] = shard[:nb * block]",
    "    out.copy_(values.view(world_size, nb * block)[:, :n].reshape(-1))\n":
    "    out.zero_().view(world_size, n)[:, :nb * block] = values.view(world_size, nb * block)\n"},
    name="_no_padding",
    doc="Only the whole blocks quantized (``n // block``): the tail of a partial block is never sent.")

_truncated = edited(
    quantized_all_gather, {"torch.round(x / scales[:, None]).clamp_(-127, 127).to(torch.int8)":
                           "(x / scales[:, None]).to(torch.int8)"},
    name="_truncated",
    doc="""``(x / scale).to(torch.int8)``: the cast truncates toward zero instead of rounding,
    an error of up to a whole step, biased toward zero.""")

_no_zero_guard = edited(
    quantized_all_gather, {"    scales[scales == 0] = 1.0  # a block of zeros: any scale gives q = 0\n": ""},
    name="_no_zero_guard",
    doc="""``scale = max |x| / 127`` without the guard for a block of zeros: its scale is 0 and
    ``x / scale`` is 0 / 0, NaN, cast to int8 (undefined).""")

_own_scales = edited(quantized_all_gather, {
    "    all_scales = torch.empty(world_size * nb)\n": "",
    "    dist.all_gather_single(all_scales, scales)\n": "",
    "all_scales.view(world_size, nb, 1)  # rank r with r's scales": "scales.view(1, nb, 1)  # this rank's scales"},
    name="_own_scales",
    doc="Every rank's int8 values dequantized with this rank's own scales (the scales never gathered).")


register(Exercise(
    "08.quantized_all_gather", "ZeRO++'s qwZ: all-gather int8 blocks with their scales",
    quantized_all_gather, _qwz_trial,
    {"one_scale": Bug(_one_scale, "per-tensor quantization", "one scale for the whole tensor"),
     "no_padding": Bug(_no_padding, "n // block blocks: the partial block dropped", "pad the shard"),
     "truncated": Bug(_truncated, "a cast to int8 without rounding", "truncates"),
     "own_scales": Bug(_own_scales, "dequantizing with this rank's scales", "scales"),
     "no_zero_guard": Bug(_no_zero_guard, "no scale 1 for a block of zeros: 0 / 0 cast to int8",
                          "cast NaN to int8")},
    stepped=False))
