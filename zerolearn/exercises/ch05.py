"""Chapter 05's exercises: ZeRO-R's partitioned checkpoints and constant buffers (paper Sec 6.1, 6.2).

* ``05.partition_checkpoint``: P_a. Each of the Nm model-parallel ranks keeps 1/Nm of a
  block's checkpoint and hands back a function that all-gathers the whole of it
  before the block is recomputed.
* ``05.constant_buffer``: CB. Average many gradients over the ranks through one fused
  buffer of a fixed size, fill after fill, so no buffer grows with the model.

``05.partition_checkpoint`` checkpoints a stack of three blocks (Linear(61, 61) and
tanh) whose input, 31 tokens x 61 features = 1,891 values, splits unevenly over 2 and
over 3 ranks; all ranks form one model-parallel group, so Nm is the world size. Its
gradients are compared with plain training in one process, its bytes with the memory
ledger. ``05.constant_buffer`` reduces the gradients of two MLPs of different sizes
through the same 1,024-element buffer.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.exercises.ch03 import kib
from zerolearn.exercises.core import Bug, Exercise, Wrong, first_difference, register
from zerolearn.memory.ledger import MemoryLedger, category

TOKENS, HIDDEN, BLOCKS, STEPS, LR = 31, 61, 3, 2, 0.1


# ----- 05.partition_checkpoint -------------------------------------------------------------

def partition_checkpoint(x, group):
    """Keep this rank's 1/Nm of the checkpoint ``x``; return a function that gives all of ``x`` back (P_a, Sec 6.1).

    Args:
        x: a checkpointed block's input, fp32, any shape (here 31 tokens x 61 features),
            the same on the Nm ranks of ``group``: under model parallelism every rank of
            a block computes the block's whole input.
        group: the Nm model-parallel ranks: ``dist.get_rank(group)``,
            ``dist.get_world_size(group)``.

    Keep piece r = elements r * c ... (r + 1) * c - 1 of x flattened, zero-padded at
    the end, c = ceil(x.numel() / Nm), and no reference to x or to a view of x: a
    view keeps x's whole storage alive. Return ``restore()``: a function of no
    arguments that gathers the pieces with one ``comm.all_gather(output, piece,
    group=group)`` and returns a tensor equal to x, of x's shape. Backward calls it
    once, just before it recomputes the block.
    """
    # BEGIN SOLUTION
    nm, rank = dist.get_world_size(group), dist.get_rank(group)
    shape, numel = x.shape, x.numel()
    c = -(-numel // nm)  # ceil(numel / nm) in integers
    padded = F.pad(x.detach().reshape(-1), (0, c * nm - numel))
    piece = padded[rank * c:(rank + 1) * c].clone()  # a copy: a view would keep all of `padded`
    del padded

    def restore():
        full = torch.empty(c * nm, dtype=piece.dtype)
        comm.all_gather(full, piece, group=group)
        return full[:numel].view(shape)

    return restore
    # END SOLUTION


def _keeps_a_view(x, group):
    nm, rank = dist.get_world_size(group), dist.get_rank(group)
    shape, numel, c = x.shape, x.numel(), math.ceil(x.numel() / nm)
    piece = F.pad(x.detach().reshape(-1), (0, c * nm - numel))[rank * c:(rank + 1) * c]  # pins the whole

    def restore():
        full = torch.empty(c * nm)
        comm.all_gather(full, piece, group=group)
        return full[:numel].view(shape)

    return restore


def _closure_keeps_x(x, group):
    nm, rank = dist.get_world_size(group), dist.get_rank(group)
    c = math.ceil(x.numel() / nm)
    piece = F.pad(x.detach().reshape(-1), (0, c * nm - x.numel()))[rank * c:(rank + 1) * c].clone()

    def restore():  # reads x.numel() and x.shape: the closure holds x itself
        full = torch.empty(c * nm)
        comm.all_gather(full, piece, group=group)
        return full[:x.numel()].view(x.shape)

    return restore


def _tensor_split(x, group):
    nm, rank = dist.get_world_size(group), dist.get_rank(group)
    shape, numel, c = x.shape, x.numel(), math.ceil(x.numel() / nm)
    mine = torch.tensor_split(x.detach().reshape(-1), nm)[rank]  # uneven: the first numel % nm pieces are longer
    piece = F.pad(mine, (0, c - mine.numel())).clone()

    def restore():
        full = torch.empty(c * nm)
        comm.all_gather(full, piece, group=group)
        return full[:numel].view(shape)

    return restore


def _all_reduce(x, group):
    nm, rank = dist.get_world_size(group), dist.get_rank(group)
    shape, numel, c = x.shape, x.numel(), math.ceil(x.numel() / nm)
    piece = F.pad(x.detach().reshape(-1), (0, c * nm - numel))[rank * c:(rank + 1) * c].clone()

    def restore():
        full = torch.zeros(c * nm)
        full[rank * c:(rank + 1) * c] = piece
        comm.all_reduce(full, group=group)  # the others' zeros add nothing: right values, twice the traffic
        return full[:numel].view(shape)

    return restore


class _Checkpointed(torch.autograd.Function):
    """``block(x)`` keeping only what the reader's function keeps; backward restores, checks, recomputes."""

    @staticmethod
    def forward(ctx, block, fn, group, check, x):
        ctx.block, ctx.check = block, check
        with category("params"):  # the trial's own copy, to check restore(); kept out of the reader's bytes
            ctx.original = x.clone()
        ctx.restore = fn(x, group)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.restore()
        ctx.check(x, ctx.original)
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return None, None, None, None, x.grad


def _check_restored(k: int, step: int, c: int, got, want: torch.Tensor) -> None:
    """Block ``k``'s restored checkpoint must equal its input in forward; the message names the rank's piece."""
    what = f"block {k}'s checkpoint as your restore() returns it"
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not torch.equal(got, want):
        i = int((got != want).flatten().nonzero()[0])
        what += f" (token {i // HIDDEN}, feature {i % HIDDEN}: in rank {i // c}'s piece)"
    first_difference(what, got, want, step=step, rtol=0, atol=0, reference="the block's input in forward")


def _stack() -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(0)
    stem = nn.Linear(HIDDEN, HIDDEN)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(BLOCKS))
    return stem, blocks


def _partition_trial(fn) -> str:
    """Two SGD steps of a stem and three checkpointed blocks, P_a over all ranks, against plain training."""
    ctx = zdist.context()
    nm = ctx.world_size
    group = dist.new_group(list(range(nm)))
    (stem, blocks), (ref_stem, ref_blocks) = _stack(), _stack()
    numel = TOKENS * HIDDEN
    c = math.ceil(numel / nm)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)
        comm.LEDGER.reset()
        with MemoryLedger(record_timeline=False) as ledger:
            with ledger.phase("forward"):
                h = stem(x)
                for k, block in enumerate(blocks):
                    h = _Checkpointed.apply(block, fn, group, functools.partial(_check_restored, k, step, c), h)
                loss = (h * target).sum()  # saves target only, not h
                del h
            held = ledger.live["activations"] - 4  # the loss itself: one fp32 value
            kept, whole = BLOCKS * 4 * c, BLOCKS * 4 * numel
            if held > 1.5 * kept:
                what = "keeps the whole checkpoint of every block" if held >= whole else f"keeps {kib(held)}"
                raise Wrong(f"after forward this rank {what}: {kib(held)} for {BLOCKS} blocks of {numel:,} values; "
                            f"P_a keeps 1/Nm of each, {kib(kept)} on each of the {nm} ranks (keep a copy of your "
                            "piece, not a view, and no reference to x)", step)
            with ledger.phase("backward"):
                loss.backward()
        moved = comm.LEDGER.volume_elements()
        ref_loss = (nn.Sequential(ref_stem, *ref_blocks)(x) * target).sum()
        ref_loss.backward()
        for (name, p), ref_p in zip([*stem.named_parameters("stem"), *blocks.named_parameters("blocks")],
                                    [*ref_stem.parameters(), *ref_blocks.parameters()]):
            first_difference(f"the gradient of {name}", p.grad, ref_p.grad, step=step,
                             reference="plain training without checkpoints")
        if moved != BLOCKS * c * nm:
            twice = " (an all-reduce counts twice)" if comm.LEDGER.as_dict()["all_reduce"]["calls"] else ""
            raise Wrong(f"your restore() calls moved {moved:,} elements in this step{twice}; P_a's all-gather of the "
                        f"padded checkpoint moves {c * nm:,} per block, {BLOCKS * c * nm:,} for {BLOCKS} blocks "
                        "(Sec 8)", step)
        with torch.no_grad():
            for p, ref_p in zip([*stem.parameters(), *blocks.parameters()],
                                [*ref_stem.parameters(), *ref_blocks.parameters()]):
                p -= LR * p.grad
                ref_p -= LR * ref_p.grad
                p.grad = ref_p.grad = None
    return (f"{STEPS} SGD steps through {BLOCKS} checkpointed blocks: gradients equal plain training, each rank "
            f"kept {kib(4 * c)} of every {kib(4 * numel)} checkpoint (1/{nm}) and moved one all-gather per block")


register(Exercise(
    "05.partition_checkpoint", "P_a: keep 1/Nm of each checkpoint, all-gather it before recomputation",
    partition_checkpoint, _partition_trial,
    {"keeps_a_view": Bug(_keeps_a_view, "slicing the piece without a copy: a view holds its base's whole "
                         "storage (the 'free' that frees nothing of STYLE.md)", "keeps the whole checkpoint"),
     "closure_keeps_x": Bug(_closure_keeps_x, "restore() reading x.shape and x.numel(): the closure holds x "
                            "itself", "keeps the whole checkpoint"),
     "tensor_split": Bug(_tensor_split, "torch.tensor_split's uneven pieces (the first numel % Nm are longer) "
                         "gathered at offsets of equal padded pieces", "in rank 1's piece"),
     "all_reduce": Bug(_all_reduce, "an all-reduce of zeros plus one's own piece instead of an all-gather: right "
                       "values, twice the traffic", "moved")}))


# ----- 05.constant_buffer ------------------------------------------------------------------

def constant_buffer(tensors, buffer, world_size):
    """Average ``tensors`` over the ranks through ``buffer``, a fused buffer of constant size (CB, Sec 6.2).

    Args:
        tensors: list of contiguous fp32 tensors of any shapes (here a model's gradients),
            n elements in all; n may be many times buffer.numel(). Averaged in place.
        buffer: fp32, 1-D, B elements: the fused buffer, the only scratch memory to use.
        world_size: the number of ranks.

    Lay the tensors' elements end to end, in list order, and take them B at a time:
    copy each run of B (the last may be shorter) into buffer (a tensor may span two
    runs, a run may hold pieces of several tensors), average the filled part over the
    ranks with one ``comm.all_reduce``, and copy it back into the tensors. Allocate
    nothing whose size grows with n (views and in-place copies allocate nothing).
    Returns None.
    """
    # BEGIN SOLUTION
    flats = [t.view(-1) for t in tensors]
    n, size = sum(f.numel() for f in flats), buffer.numel()
    for lo in range(0, n, size):  # one fill: elements lo ... hi - 1 of the tensors laid end to end
        hi = min(lo + size, n)
        pieces, offset = [], 0
        for f in flats:
            a, b = max(lo, offset), min(hi, offset + f.numel())
            if a < b:
                pieces.append((f[a - offset:b - offset], buffer[a - lo:b - lo]))
            offset += f.numel()
        for part, fused in pieces:
            fused.copy_(part)
        comm.all_reduce(buffer[:hi - lo])
        buffer[:hi - lo].div_(world_size)
        for part, fused in pieces:
            part.copy_(fused)
    # END SOLUTION


def _grows_with_model(tensors, buffer, world_size):
    fused = torch.cat([t.view(-1) for t in tensors])  # one buffer as large as the model
    comm.all_reduce(fused)
    fused /= world_size
    offset = 0
    for t in tensors:
        t.view(-1).copy_(fused[offset:offset + t.numel()])
        offset += t.numel()


def _drops_tail(tensors, buffer, world_size):
    flats = [t.view(-1) for t in tensors]
    n, size = sum(f.numel() for f in flats), buffer.numel()
    for lo in range(0, n - size + 1, size):  # only full fills: the last, shorter one is never reduced
        pieces, offset = [], 0
        for f in flats:
            a, b = max(lo, offset), min(lo + size, offset + f.numel())
            if a < b:
                pieces.append((f[a - offset:b - offset], buffer[a - lo:b - lo]))
            offset += f.numel()
        for part, fused in pieces:
            fused.copy_(part)
        comm.all_reduce(buffer)
        buffer.div_(world_size)
        for part, fused in pieces:
            part.copy_(fused)


BUFFER = 1024  # elements: 4 KiB of fp32
MODELS = {"small": (17, 33, 64, 5), "large": (17, 97, 150, 5)}  # MLP widths: n = 3,095 and 17,201


def _gradients(widths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        out += [torch.randn(fan_out, fan_in, generator=g), torch.randn(fan_out, generator=g)]
    return out


def _buffer_trial(fn) -> str:
    """Each rank's own gradients of two MLPs averaged through one 1,024-element buffer."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    buffer = torch.zeros(BUFFER)
    peaks, sizes = {}, {}
    for model, widths in MODELS.items():
        grads, before = _gradients(widths, rank), _gradients(widths, rank)
        want = [sum(ts) / ws for ts in zip(*(_gradients(widths, r) for r in range(ws)))]
        n = sizes[model] = sum(t.numel() for t in grads)
        comm.LEDGER.reset()
        with MemoryLedger(record_timeline=False) as ledger:
            fn(grads, buffer, ws)
        peaks[model] = ledger.peak
        offset = 0
        for k, (got, w, old) in enumerate(zip(grads, want, before)):
            untouched = torch.isclose(got, old) & ~torch.isclose(got, w)
            if untouched.any():
                first = offset + int(untouched.flatten().nonzero()[0])
                raise Wrong(f"the {model} model's values from element {first:,} of {n:,} on were not averaged "
                            f"(tensor {k}, shape {tuple(got.shape)}): the last, partly filled buffer must be "
                            "reduced too")
            first_difference(f"the {model} model's tensor {k} (shape {tuple(got.shape)})", got, w,
                             reference="the average over ranks")
            offset += got.numel()
        calls = comm.LEDGER.as_dict()["all_reduce"]["calls"]
        if calls != math.ceil(n / BUFFER) and ledger.peak <= 4 * BUFFER:
            raise Wrong(f"your function made {calls} all-reduce calls for the {model} model's {n:,} values; "
                        f"{BUFFER:,} at a time takes {math.ceil(n / BUFFER)}")
    if max(peaks.values()) > 4 * BUFFER:
        raise Wrong(f"your function allocated {kib(peaks['small'])} for the small model ({sizes['small']:,} values) "
                    f"and {kib(peaks['large'])} for the large one ({sizes['large']:,}): a fused buffer that grows "
                    f"with the model; CB's stays {kib(4 * BUFFER)} whatever the model's size (Sec 6.2)")
    return (f"two models of {sizes['small']:,} and {sizes['large']:,} values averaged exactly through one "
            f"{kib(4 * BUFFER)} buffer, nothing else allocated")


register(Exercise(
    "05.constant_buffer", "CB: average gradients through one fused buffer of constant size",
    constant_buffer, _buffer_trial,
    {"grows_with_model": Bug(_grows_with_model, "fusing every gradient into one buffer before the all-reduce, as "
                             "Sec 6.2 says Megatron-LM and DP implementations did (12 GB for 3B parameters)",
                             "grows with the model"),
     "drops_tail": Bug(_drops_tail, "a fill loop over whole buffers only (range(0, n - B + 1, B)): the "
                       "shorter last fill is never reduced", "were not averaged")}))
