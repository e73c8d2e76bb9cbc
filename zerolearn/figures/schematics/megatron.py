"""Megatron's column / row split and P_a's partitioned activation checkpoint (Sec 6.1, Sec 8).

The blocks drawn are those :mod:`zerolearn.residual.tensor_parallel` keeps: a
``ColumnParallelLinear`` built from a full ``nn.Linear`` holds rows (output features) of its
weight, a ``RowParallelLinear`` columns (input features); both are built here from one full
layer and their weights compared with its blocks. The two autograd functions are named with
their own docstrings. The checkpoint chunks are those :class:`zerolearn.residual.checkpointing.
CheckpointStore` keeps under P_a: the block's input flattened, padded to Nm equal chunks,
chunk r on rank r (its ``save``, run for each rank without communication), all-gathered
before the recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from torch import nn

from zerolearn.errors import ConfigError, require_count
from zerolearn.figures.schematics.palette import PADDING_HATCH, arrow, box, rank_color
from zerolearn.memory.model import partitioned_checkpoint_bytes
from zerolearn.residual import tensor_parallel as tp
from zerolearn.residual.checkpointing import CheckpointStore

__all__ = ["CheckpointChunks", "TensorSplit", "checkpoint_chunks", "megatron_figure", "tensor_split"]


@dataclass(frozen=True)
class TensorSplit:
    """Which block of a (out, in) weight each of Nm ranks holds.

    ``column[r]``: ``(row start, row end)`` of rank r's ``ColumnParallelLinear`` (all columns);
    ``row[r]``: ``(column start, column end)`` of its ``RowParallelLinear`` (all rows).
    ``functions``: the autograd functions' names -> first line of their docstrings.
    """

    out_features: int
    in_features: int
    nm: int
    column: list[tuple[int, int]]
    row: list[tuple[int, int]]
    functions: dict[str, str]


def tensor_split(out_features: int = 6, in_features: int = 4, nm: int = 2) -> TensorSplit:
    """Split one ``nn.Linear(in_features, out_features)`` as the package's tensor parallelism does.

    Raises:
        ConfigError: a size < 1, ``nm`` outside 1-8, or ``nm`` dividing neither size.
    """
    for name, value in (("out_features", out_features), ("in_features", in_features), ("nm", nm)):
        require_count(name, value)
    if nm > 8 or out_features % nm or in_features % nm:
        raise ConfigError(f"nm {nm}: allowed are 1-8 ranks dividing out_features {out_features} and in_features "
                          f"{in_features}")
    full = nn.Linear(in_features, out_features)
    column, row = [], []
    for r in range(nm):
        rows = torch.arange(r * out_features // nm, (r + 1) * out_features // nm)
        cols = torch.arange(r * in_features // nm, (r + 1) * in_features // nm)
        c, w = tp.ColumnParallelLinear(full, rows, None), tp.RowParallelLinear(full, cols, None)
        if not (torch.equal(c.weight, full.weight[rows]) and torch.equal(w.weight, full.weight[:, cols])):
            raise AssertionError("tensor_parallel's blocks differ from the full weight's")  # the picture would lie
        column.append((int(rows[0]), int(rows[-1]) + 1))
        row.append((int(cols[0]), int(cols[-1]) + 1))
    functions = {f.__name__: (f.__doc__ or "").strip().splitlines()[0]
                 for f in (tp._CopyToParallel, tp._ReduceFromParallel)}
    return TensorSplit(out_features, in_features, nm, column, row, functions)


@dataclass(frozen=True)
class CheckpointChunks:
    """P_a on one checkpoint of ``numel`` values: rank r keeps ``chunks[r]`` = ``(start, end)`` of
    the flattened, padded checkpoint (``padded`` values in all); ``bytes_per_rank`` from
    :func:`partitioned_checkpoint_bytes` for one layer."""

    numel: int
    padded: int
    nm: int
    chunks: list[tuple[int, int]]
    bytes_per_rank: float


def checkpoint_chunks(batch: int = 1, seq_len: int = 4, hidden: int = 5, nm: int = 3) -> CheckpointChunks:
    """The chunk of a (batch, seq_len, hidden) checkpoint each of ``nm`` ranks keeps under P_a
    (Sec 6.1), from ``CheckpointStore.save`` with ``partition`` on.

    Raises:
        ConfigError: a size < 1 or ``nm`` outside 1-8.
    """
    for name, value in (("batch", batch), ("seq_len", seq_len), ("hidden", hidden), ("nm", nm)):
        require_count(name, value)
    if nm > 8:
        raise ConfigError(f"nm {nm}: allowed are 1 to 8 ranks in a drawing")
    x = torch.arange(batch * seq_len * hidden, dtype=torch.float32).view(batch, seq_len, hidden)
    chunks = []
    for r in range(nm):
        store = CheckpointStore()
        store.partition, store.nm, store.rank = True, nm, r  # rank r of nm, without a process group
        held = store.saved[store.save(x)].data
        start = r * held.numel()
        padded = torch.nn.functional.pad(x.reshape(-1), (0, nm * held.numel() - x.numel()))
        if not torch.equal(held, padded[start:start + held.numel()]):
            raise AssertionError("CheckpointStore's chunk is not the slice drawn")  # the picture would lie
        chunks.append((start, start + held.numel()))
    return CheckpointChunks(x.numel(), chunks[-1][1], nm, chunks,
                            partitioned_checkpoint_bytes(hidden, batch, seq_len, 1, nm))


def megatron_figure(nm: int = 2, out_features: int = 6, in_features: int = 4) -> Figure:
    """Three panels: the column split (rows of W by rank, identity forward / all-reduce backward),
    the row split (columns by rank, all-reduce forward / identity backward), and P_a's checkpoint,
    1/Nm per rank, all-gathered before recompute (:func:`tensor_split`, :func:`checkpoint_chunks`)."""
    split = tensor_split(out_features, in_features, nm)
    ck = checkpoint_chunks(nm=nm)
    fig = Figure(figsize=(10, 3.3), layout="constrained")
    col_ax, row_ax, pa_ax = fig.subplots(1, 3, width_ratios=[1, 1, 1.4])
    for ax, blocks, by_rows, name in ((col_ax, split.column, True, "_CopyToParallel"),
                                      (row_ax, split.row, False, "_ReduceFromParallel")):
        for r, (a, b) in enumerate(blocks):
            for i in range(a, b):
                for j in range(split.in_features if by_rows else split.out_features):
                    x, y = (j, split.out_features - 1 - i) if by_rows else (i, split.out_features - 1 - j)
                    box(ax, x, y, 0.95, 0.95, rank_color(r), f"r{r}" if (i, j) == (a, 0) else "", text_color="white")
        ax.set_xlim(-0.2, split.in_features + 0.2)
        ax.set_ylim(-1.9, split.out_features + 0.2)
        ax.set_aspect("equal")
        ax.axis("off")
        kind = "column-parallel: rows (outputs) per rank" if by_rows else "row-parallel: columns (inputs) per rank"
        ax.set_title(f"{kind}\nW ({split.out_features} x {split.in_features})", fontsize=8)
        ax.text(split.in_features / 2, -1.0, f"{name}:\n{split.functions[name]}", ha="center", va="center",
                fontsize=6, wrap=True)
    n = ck.padded
    for r, (a, b) in enumerate(ck.chunks):
        for e in range(n):
            y = ck.nm - r
            held = a <= e < b
            box(pa_ax, e, y, 0.95, 0.8, rank_color(r), held=held, hatch=PADDING_HATCH if e >= ck.numel else None)
        pa_ax.text(-0.5, ck.nm - r + 0.4, f"rank {r}", ha="right", va="center", fontsize=7)
    for e in range(n):
        box(pa_ax, e, -0.6, 0.95, 0.8, rank_color(e // (n // ck.nm)), hatch=PADDING_HATCH if e >= ck.numel else None)
    arrow(pa_ax, (n / 2, 0.9), (n / 2, 0.3), "0.3", width=1.5)
    pa_ax.text(n / 2 + 0.5, 0.55, "all-gather,\nthen recompute", fontsize=7, va="center")
    pa_ax.text(-0.5, -0.2, "recompute", ha="right", va="center", fontsize=7)
    pa_ax.set_xlim(-3, n + 0.2)
    pa_ax.set_ylim(-0.8, ck.nm + 1.0)
    pa_ax.axis("off")
    pa_ax.set_title(f"P_a: 1/Nm of a checkpoint per rank (Nm = {ck.nm})\n"
                    f"{ck.numel} values, padded to {ck.padded}; {ck.bytes_per_rank:g} B per rank (bf16)",
                    fontsize=8)
    fig.suptitle("Megatron's tensor parallelism (Sec 8) and ZeRO-R's partitioned checkpoint (Sec 6.1)", fontsize=9)
    return fig
