"""Chapter 0, the memory wall: measure where training memory goes (paper Sec 3).

The chapter counts bytes from real tensors and sets them beside the paper's
formulas in :mod:`zerolearn.memory.model`:

* :func:`reports` runs the training CLI on spawned ranks for several configurations
  (model states: params, grads, optimizer states; Sec 3.1);
* :func:`measure_activations` watches one forward pass with the memory ledger
  (residual states: activations, with and without checkpointing; Sec 3.2);
* :func:`block_saved_tensors` lists what autograd keeps of one transformer block;
* :func:`step_timeline` records one training step, allocation by allocation.

The chapter's exercises (``00.model_state_bytes``, ``00.max_batch``) are beside this
module, in :mod:`zerolearn.chapters.ch00`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import data
from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.engines import make_engine
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.models import GPTConfig, build_model
from zerolearn.precision import DTYPES
from zerolearn.residual.checkpointing import CheckpointStore


def reports(configs: list[TrainConfig]) -> list[dict]:
    """The training report (docs/ARCHITECTURE.md, "The training run") of each configuration, in order.

    Runs on every rank of an existing process group, so one :func:`zerolearn.dist.launch`
    serves several runs: ``launch(reports, world_size, [config1, config2])``.
    """
    from zerolearn.train import train

    return [train(config) for config in configs]


def measure_activations(n_layer: int, batch: int, seq_len: int, d_model: int = 64, n_head: int = 4,
                        dtype: str = "fp32", checkpointing: bool = False) -> int:
    """Bytes of activations our GPT holds between forward and backward (Sec 3.2).

    Builds the GPT, registers its parameters with a :class:`MemoryLedger` (so views
    of weights are not mistaken for new tensors), runs one forward pass on a batch of
    ``batch`` x ``seq_len`` bytes and returns the ledger's ``activations``: every
    storage created during forward and still alive when it ends, which is what
    autograd keeps for backward plus the logits. With ``checkpointing`` each block
    keeps only its input and recomputes the rest in backward.

    Runs in the calling process; no process group is needed.
    """
    model = build_model("gpt", 0, gpt=GPTConfig(seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                                                d_model=d_model)).to(DTYPES[dtype])
    if checkpointing:
        model.checkpoint_store = CheckpointStore()
    x, _ = data.gpt_batch(0, batch, seq_len)
    with MemoryLedger(record_timeline=False) as ledger:
        ledger.track(model.parameters(), "params")
        with ledger.phase("forward"):
            logits = model(x)
        held = ledger.live["activations"]
    del logits
    return held


def block_saved_tensors(block: nn.Module, x: torch.Tensor) -> list[dict]:
    """The storages autograd keeps for the backward of ``block(x)``, in forward order.

    Walks the graph from the output back to ``x`` and reads each node's ``_saved_*``
    attributes. One row per storage: ``shape`` (of the first tensor seen in it),
    ``bytes`` and ``saved_by`` (``"Node.input"`` names: q, k and v, for instance,
    are three views of one storage). Parameters are left out (they are model
    states), and so is ``x`` itself, whose cost is the previous block's output.
    """
    out = block(x)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    rows: dict[int, dict] = {}
    stack, visited = [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        for attr in sorted(a for a in dir(fn) if a.startswith("_saved_")):
            try:
                value = getattr(fn, attr)
            except RuntimeError:  # released already
                continue
            if not isinstance(value, torch.Tensor) or value.untyped_storage().data_ptr() in skip:
                continue
            row = rows.setdefault(value.untyped_storage().data_ptr(),
                                  {"shape": tuple(value.shape), "bytes": value.untyped_storage().nbytes(),
                                   "saved_by": [], "order": fn._sequence_nr(), "seen": len(rows)})
            row["saved_by"].append(f"{type(fn).__name__.removesuffix('Backward0')}.{attr[len('_saved_'):]}")
            row["order"] = min(row["order"], fn._sequence_nr())  # nodes are numbered as forward creates them
        stack.extend(f for f, _ in fn.next_functions)
    # Ties (one node saving several storages): the walk meets later tensors first.
    return sorted(rows.values(), key=lambda r: (r["order"], -r["seen"]))


def step_timeline(dtype: str = "bf16", optimizer: str = "adam", stage: int = 0, batch: int = 8,
                  seq_len: int = 32, d_model: int = 64, n_layer: int = 2) -> dict:
    """One training step of our GPT watched by the memory ledger, event by event.

    Run on spawned ranks (``launch(step_timeline, world_size)``). A first step runs
    unwatched so Adam's moments exist, as in any later step; the second is watched,
    with the batch built before the ledger starts, so the ledger sees the step only.
    Returns ``{"timeline": [[index, phase, total bytes, {category: bytes}], ...],
    "peak_bytes", "peak_by_category"}`` for this rank.
    """
    ctx = zdist.context()
    model = build_model("gpt", 0, gpt=GPTConfig(seq_len=seq_len, n_layer=n_layer, d_model=d_model))
    engine = make_engine(stage, model, optimizer=optimizer, dtype=dtype, bucket_mb=4.0)
    for step in range(2):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in data.gpt_batch(step, batch, seq_len))
        with MemoryLedger() if step == 1 else contextlib.nullcontext() as ledger:
            if ledger is not None:
                ledger.track_engine(engine)
            with ledger.phase("forward") if ledger else contextlib.nullcontext():
                loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
            with ledger.phase("backward") if ledger else contextlib.nullcontext():
                engine.backward(loss)
                del loss
            with ledger.phase("step") if ledger else contextlib.nullcontext():
                engine.step()
                engine.zero_grad()
    return {"timeline": [[e.index, e.phase, e.total, e.by_category] for e in ledger.timeline],
            "peak_bytes": ledger.peak, "peak_by_category": dict(ledger.peak_by_category)}
