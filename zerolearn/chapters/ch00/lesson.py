"""Chapter 0, the memory wall: what autograd keeps of one transformer block (paper Sec 3.2).

:func:`block_saved_tensors` lists the storages a block's backward needs, the walk behind the
chapter's table of activations. The rest of what the chapter runs (the training reports,
one step watched by the memory ledger, activations measured with and without
checkpointing) is written in the notebook's cells.

The chapter's exercises (``00.model_state_bytes``, ``00.max_batch``) are beside this
module, in :mod:`zerolearn.chapters.ch00`.
"""

from __future__ import annotations

import torch
from torch import nn


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
