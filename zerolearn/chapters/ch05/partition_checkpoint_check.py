"""Exercise ``05.partition_checkpoint``'s check: ZeRO-R's partitioned checkpoints, P_a (paper Sec 6.1).

Each of the Nm model-parallel ranks keeps 1/Nm of a block's checkpoint and hands back
a function that all-gathers the whole of it before the block is recomputed. The trial
checkpoints a stack of three blocks (Linear(61, 61) and tanh) whose input, 31 tokens x
61 features = 1,891 values, splits unevenly over 2 and over 3 ranks; on 2 and 3 ranks all
ranks form one model-parallel group, on 4 ranks two groups of 2 that are neither the world
nor in rank order ([2, 0] and [3, 1]), so a rank's place in its group is not its global
rank. It trains two SGD steps and checks every restored checkpoint against the block's
input, the gradients against plain training in one process, the bytes kept after forward
(memory ledger), and one all-gather per block, over the group, of this rank's own piece.
A buffer freed too early (its storage resized to 0 bytes) is named before anything reads
it, with the reader's line that freed it: x itself (the caller still reads it), a piece
that is a view of a freed buffer, an all-gather's output, or what restore() returns.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch05.partition_checkpoint`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch05.partition_checkpoint import partition_checkpoint
from zerolearn.exercises.core import (
    Bug,
    Exercise,
    Wrong,
    agree,
    edited,
    first_difference,
    machinery,
    readers_line,
    register,
)
from zerolearn.exercises.helpers import allocated, freed_where, watching_frees
from zerolearn.memory.ledger import MemoryLedger, category
from zerolearn.tables import kib

TOKENS, HIDDEN, BLOCKS, STEPS, LR = 31, 61, 3, 2, 0.1


_keeps_a_view = edited(partition_checkpoint, {
    "piece = padded[rank * c:(rank + 1) * c].clone()  # a copy: a view would keep all of `padded`":
    "piece = padded[rank * c:(rank + 1) * c]  # pins the whole"}, name="_keeps_a_view")

_closure_keeps_x = edited(partition_checkpoint, {
    "        return full[:numel].view(shape)\n":
    "        return full[:x.numel()].view(x.shape)  # reads x.numel() and x.shape: the closure holds x itself\n"},
    name="_closure_keeps_x")

_tensor_split = edited(partition_checkpoint, {
    "    padded = F.pad(x.detach().reshape(-1), (0, c * nm - numel))\n"
    "    piece = padded[rank * c:(rank + 1) * c].clone()  # a copy: a view would keep all of `padded`\n"
    "    del padded\n":
    "    mine = torch.tensor_split(x.detach().reshape(-1), nm)[rank]"
    "  # uneven: the first numel % nm pieces are longer\n"
    "    piece = F.pad(mine, (0, c - mine.numel())).clone()\n"}, name="_tensor_split")

_all_reduce = edited(partition_checkpoint, {
    "        full = torch.empty(c * nm, dtype=piece.dtype)\n"
    "        dist.all_gather_single(full, piece, group=group)\n":
    "        full = torch.zeros(c * nm, dtype=piece.dtype)\n        full[rank * c:(rank + 1) * c] = piece\n"
    "        dist.all_reduce(full, group=group)  # the others' zeros add nothing: right values, twice the traffic\n"},
    name="_all_reduce")

_global_rank = edited(partition_checkpoint, {
    "nm, rank = dist.get_world_size(group), dist.get_rank(group)":
    "nm, rank = dist.get_world_size(group), dist.get_rank()  # the global rank, not the rank in the group"},
    name="_global_rank")

_world_gather = edited(partition_checkpoint, {
    "dist.all_gather_single(full, piece, group=group)":
    "dist.all_gather_single(full, piece)  # no group=: every rank of the world"}, name="_world_gather")

_frees_x = edited(partition_checkpoint, {
    "    del padded\n": "    del padded\n"
    "    x.untyped_storage().resize_(0)  # frees the caller's tensor, which the block's forward still reads\n"},
    name="_frees_x")

_frees_under_the_piece = edited(partition_checkpoint, {
    "    piece = padded[rank * c:(rank + 1) * c].clone()  # a copy: a view would keep all of `padded`\n"
    "    del padded\n":
    "    piece = padded[rank * c:(rank + 1) * c]  # a view: it shares padded's storage\n"
    "    padded.untyped_storage().resize_(0)  # frees the piece with it\n"}, name="_frees_under_the_piece")


@dataclass(frozen=True)
class _Block:
    """What the trial checks around block ``k``'s checkpoint in ``step``: ``c`` elements a piece;
    ``freed``: where the reader's code freed storage (:func:`watching_frees`)."""

    k: int
    step: int
    c: int
    freed: dict

    def kept(self, x: torch.Tensor) -> None:
        """x, the caller's tensor, must still hold its bytes when partition_checkpoint returns."""
        if not allocated(x):
            raise Wrong(f"partition_checkpoint freed x, block {self.k}'s input{freed_where(x, self.freed)}: x "
                        "belongs to the caller, whose forward reads it again once your function returns (the "
                        "block runs on it); keep a copy of your piece and drop your references to x instead, "
                        "and x is freed when its last user lets go of it", self.step)

    def restored(self, got, want: torch.Tensor) -> None:
        """Block ``k``'s restored checkpoint must equal its input in forward; the message names the rank's piece."""
        if not allocated(got):
            raise Wrong(f"your restore() returned block {self.k}'s checkpoint in a tensor whose storage holds 0 "
                        f"bytes{freed_where(got, self.freed)}: the block is recomputed from it after restore() "
                        "returns; free a buffer only once nothing reads it (return a tensor that owns its "
                        "memory)", self.step)
        what = f"block {self.k}'s checkpoint as your restore() returns it"
        if isinstance(got, torch.Tensor) and got.shape == want.shape and not torch.equal(got, want):
            i = int((got != want).flatten().nonzero()[0])
            what += f" (token {i // HIDDEN}, feature {i % HIDDEN}: in rank {i // self.c}'s piece)"
        first_difference(what, got, want, step=self.step, rtol=0, atol=0,
                         reference="the block's input in forward")


class _Checkpointed(torch.autograd.Function):
    """``block(x)`` keeping only what the reader's function keeps; backward restores, checks, recomputes."""

    @staticmethod
    def forward(ctx, block, fn, group, check: _Block, x):
        ctx.block, ctx.check = block, check
        with category("params"):  # the trial's own copy, to check restore(); kept out of the reader's bytes
            ctx.original = x.clone()
        ctx.restore = fn(x, group)
        check.kept(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        _RESTORING["x"] = ctx.original  # what the all-gather's piece is checked against
        x = ctx.restore()
        ctx.check.restored(x, ctx.original)
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return None, None, None, None, x.grad


def _stack() -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(0)
    stem = nn.Linear(HIDDEN, HIDDEN)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(BLOCKS))
    return stem, blocks


_RESTORING: dict = {}  # the checkpoint being restored now, on this rank


def _mp_group(world_size: int):
    """The trial's model-parallel group and its members: the world in rank order on 2 and 3 ranks;
    on 4, two groups of 2 (data parallelism x model parallelism = 2 x 2), strided and in reverse
    rank order, [2, 0] and [3, 1], so that a rank's place in its group is not its global rank."""
    if world_size != 4:
        members = [list(range(world_size))]
    else:
        members = [[2, 0], [3, 1]]
    rank = dist.get_rank()
    groups = [dist.new_group(m, sort_ranks=False) for m in members]  # every rank creates every group
    mine = next(i for i, m in enumerate(members) if rank in m)
    return groups[mine], members[mine]


class _CheckedAllGathers(TorchDispatchMode):
    """While on, every all-gather into one tensor is checked before it runs, whatever name called
    it (``dist.all_gather_single``, ``dist.all_gather_single``, :func:`zerolearn.comm.all_gather`:
    torch dispatches each as the operator ``c10d::_allgather_base_``): buffers that hold their
    bytes, over ``group``, and with this rank's piece of the checkpoint being restored (its place
    in the group, not its global rank). Then the ranks agree that every call was right, so that
    none enters the collective to wait for a rank that stopped. An error inside the collective is
    the reader's, at its line."""

    def __init__(self, group, members: list[int], step_of, freed: dict):
        super().__init__()
        self.group, self.members, self.step_of, self.freed, self.calls = group, members, step_of, freed, 0

    @machinery
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname == "_allgather_base_":
            step = self.step_of()
            self.calls += 1
            output, input = args[0], args[1]
            self._check_buffers(output, input, step)
            self._check_call(dist.ProcessGroup.unbox(args[2]), input, step)
            agree(step, point=f"all_gather {self.calls}")  # every rank's call was right: none waits for a stopped one
        return func(*args, **(kwargs or {}))

    @machinery
    def _check_buffers(self, output, input, step):
        line = readers_line()
        if not allocated(input):
            raise Wrong(f"your restore() all-gathers a piece whose storage holds 0 bytes{line}: it is a view of "
                        f"a buffer that was freed{freed_where(input, self.freed)}; keep a copy of your piece "
                        "(.clone()), which owns its memory, and free or drop the rest", step)
        if not allocated(output):
            where = freed_where(output, self.freed)
            raise Wrong(f"your restore() all-gathers into an output whose storage holds 0 bytes{line}: "
                        f"{f'it was freed{where}' if where else 'it was freed or never allocated'}; allocate it "
                        "(torch.empty) or grow its storage back (untyped_storage().resize_(bytes)) before the "
                        "all-gather writes into it", step)

    @machinery
    def _check_call(self, group, input, step):
        members = self.members
        if group is not self.group:
            over = ("the default group, every rank" if group is None or group == dist.group.WORLD else
                    f"a group of ranks {dist.get_process_group_ranks(group)}")
            raise Wrong(f"your restore() all-gathered over {over}, not the model-parallel group it was given "
                        f"(ranks {members}): pass group=group", step)
        x = _RESTORING.get("x")
        rank, mine = dist.get_rank(), members.index(dist.get_rank())
        if x is not None and rank != mine and isinstance(input, torch.Tensor):
            nm, numel = len(members), x.numel()
            c = math.ceil(numel / nm)
            flat = F.pad(x.reshape(-1), (0, c * nm - numel))
            theirs = flat[rank * c:(rank + 1) * c]
            right = flat[mine * c:(mine + 1) * c]
            if not (input.shape == right.shape and torch.equal(input, right)) and \
                    (input.numel() == theirs.numel() and torch.equal(input.reshape(-1), theirs)):
                empty = "" if theirs.numel() else f" (an empty one: there are {nm} pieces)"
                raise Wrong(f"this rank kept piece {rank} of the checkpoint{empty}, for its global rank {rank}; in the "
                            f"model-parallel group (ranks {members}) it is rank {mine} and keeps piece {mine}: "
                            "use dist.get_rank(group), the rank in the group, not dist.get_rank()", step)


def _partition_trial(fn) -> str:
    """Two SGD steps of a stem and three checkpointed blocks, P_a over a model-parallel group
    (the world on 2 and 3 ranks, 2 x 2 on 4), against plain training."""
    ctx = zdist.context()
    group, members = _mp_group(ctx.world_size)
    nm = len(members)
    now = {"step": 0}
    try:
        with watching_frees() as freed, _CheckedAllGathers(group, members, lambda: now["step"], freed):
            return _partition_steps(fn, group, nm, now, freed)
    finally:
        _RESTORING.clear()


def _partition_steps(fn, group, nm: int, now: dict, freed: dict) -> str:
    (stem, blocks), (ref_stem, ref_blocks) = _stack(), _stack()
    numel = TOKENS * HIDDEN
    c = math.ceil(numel / nm)
    for step in range(STEPS):
        now["step"] = step
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)
        comm.LEDGER.reset()
        with MemoryLedger(record_timeline=False) as ledger:
            with ledger.phase("forward"):
                h = stem(x)
                for k, block in enumerate(blocks):
                    h = _Checkpointed.apply(block, fn, group, _Block(k, step, c, freed), h)
                loss = (h * target).sum()  # saves target only, not h
                del h
            held = ledger.live["activations"] - 4  # the loss itself: one fp32 value
            kept, whole = BLOCKS * 4 * c, BLOCKS * 4 * numel
            if held > 1.5 * kept:
                what = "keeps the whole checkpoint of every block" if held >= whole else f"keeps {kib(held, unit=True)}"
                raise Wrong(f"after forward this rank {what}: {kib(held, unit=True)} for {BLOCKS} blocks of "
                            f"{numel:,} values; P_a keeps 1/Nm of each, {kib(kept, unit=True)} on each of the {nm} "
                            "ranks (keep a copy of your piece, not a view, and no reference to x)", step)
            with ledger.phase("backward"):
                loss.backward()
        moved = comm.LEDGER.volume_elements()
        ref_loss = (nn.Sequential(ref_stem, *ref_blocks)(x) * target).sum()
        ref_loss.backward()
        for (name, p), ref_p in zip([*stem.named_parameters("stem"), *blocks.named_parameters("blocks")],
                                    [*ref_stem.parameters(), *ref_blocks.parameters()], strict=True):
            first_difference(f"the gradient of {name}", p.grad, ref_p.grad, step=step,
                             reference="plain training without checkpoints")
        if moved != BLOCKS * c * nm:
            twice = " (an all-reduce counts twice)" if comm.LEDGER.as_dict()["all_reduce"]["calls"] else ""
            raise Wrong(f"your restore() calls moved {moved:,} elements in this step{twice}; P_a's all-gather of the "
                        f"padded checkpoint moves {c * nm:,} per block, {BLOCKS * c * nm:,} for {BLOCKS} blocks "
                        "(Sec 8)", step)
        with torch.no_grad():
            for p, ref_p in zip([*stem.parameters(), *blocks.parameters()],
                                [*ref_stem.parameters(), *ref_blocks.parameters()], strict=True):
                p -= LR * p.grad
                ref_p -= LR * ref_p.grad
                p.grad = ref_p.grad = None
        agree(step)
    return (f"{STEPS} SGD steps through {BLOCKS} checkpointed blocks: gradients equal plain training, each rank "
            f"kept {kib(4 * c, unit=True)} of every {kib(4 * numel, unit=True)} checkpoint (1/{nm}) and moved one "
            "all-gather per block")


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
                       "values, twice the traffic", "moved"),
     "global_rank": Bug(_global_rank, "dist.get_rank() for the piece: right while the model-parallel group is "
                        "the world in rank order, wrong in a 2 x 2 layout", "use dist.get_rank(group)"),
     "world_gather": Bug(_world_gather, "dist.all_gather_single without group=: the default group, every rank",
                         "pass group=group"),
     "frees_x": Bug(_frees_x, "x's storage resized to 0 bytes to free the checkpoint: x is the caller's, and "
                    "the block's forward still reads it", "partition_checkpoint freed x"),
     "frees_under_the_piece": Bug(_frees_under_the_piece, "the padded copy freed while the piece is a view of it: "
                                  "the all-gather reads freed memory (gloo would crash the rank)",
                                  "a view of a buffer that was freed (line")},
    world_sizes=(2, 4, 3)))
