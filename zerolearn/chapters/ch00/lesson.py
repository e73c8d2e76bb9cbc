"""Chapter 0, the memory wall: what autograd keeps of one transformer block (paper Sec 3.2).

:func:`block_saved_tensors` lists the storages a block's backward needs, the walk behind the
chapter's table of activations; :func:`step_timeline_figure` and :func:`memory_bars_figure` only lay
out two figures. The rest of what the chapter runs (the training reports, one step watched
by the memory ledger, activations measured with and without checkpointing) is written in
the notebook's cells.

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


def step_timeline_figure(timeline: list, title: str):
    """A stack plot of one step's memory by category, from ``[index, phase, total, by_category]``
    events (the ledger's timeline), with a dashed line where each phase starts. Bytes in KiB.

    Event i's bytes are drawn from i to i + 1, the last event's too, so what the step leaves
    (after ``zero_grad()``) shows at the right edge; an arrow marks the event that frees the
    gradients, the last at which they fall to 0 bytes."""
    import matplotlib.pyplot as plt

    order = ("params", "optimizer_states", "grads", "activations", "temporary")
    xs = [e[0] for e in timeline] + [timeline[-1][0] + 1]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(xs, [[e[3][c] / 1024 for e in timeline] + [timeline[-1][3][c] / 1024] for c in order],
                 labels=order, step="post")
    ax.set_xlim(xs[0], xs[-1])
    for phase in ("forward", "backward", "step"):
        start = next(e[0] for e in timeline if e[1] == phase)
        ax.axvline(start, color="k", lw=0.8, ls="--")
        ax.text(start + 1, ax.get_ylim()[1] * 0.95, phase, va="top")
    freed = [(a, b) for a, b in zip(timeline, timeline[1:], strict=False)
             if a[3]["grads"] > 0 and b[3]["grads"] == 0]
    if freed:  # the last event at which the gradients go: zero_grad()
        before, at = freed[-1]
        y = (before[3]["params"] + before[3]["optimizer_states"] + before[3]["grads"] / 2) / 1024
        ax.annotate("gradients freed\nat zero_grad()", xy=(at[0] + 0.5, y), xytext=(-90, 45),
                    textcoords="offset points", ha="center", va="center", fontsize=8,
                    arrowprops={"arrowstyle": "->", "color": "k", "lw": 0.8})
    ax.set_xlabel("allocation or free event within one training step (index)")
    ax.set_ylabel("bytes held by rank 0 (KiB)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    return fig


_PARTS = {"params": "params (fp16)", "grads": "grads (fp16)", "optimizer_states": "optimizer states (fp32)",
          "activations": "activations (fp16)", "recompute": "recompute of one block",
          "temporary_buffers": "fp32 buffer of all gradients (Sec 3.2's example)"}


def memory_bars_figure(budgets: dict, device_bytes: float, title: str):
    """Stacked bars of :func:`zerolearn.memory.fit.per_device_bytes` results, one bar per
    scenario (``{label: breakdown}``), in decimal GB, with the device's size as a line."""
    import matplotlib.pyplot as plt

    gb = 1e9
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, parts in enumerate(budgets.values()):
        bottom = 0.0
        for j, (key, name) in enumerate(_PARTS.items()):
            ax.bar(i, parts[key] / gb, bottom=bottom, color=f"C{j}", label=name if i == 0 else None)
            bottom += parts[key] / gb
    ax.axhline(device_bytes / gb, color="k", ls="--", lw=1)
    ax.text((len(budgets) - 1) / 2, device_bytes / gb + 1, f"one {device_bytes / gb:.0f} GB GPU", ha="center")
    ax.set_xticks(range(len(budgets)), [f"{k}\n{v['total'] / gb:.1f} GB in all" for k, v in budgets.items()])
    ax.set_ylabel("memory per GPU (GB, 10^9 bytes)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    return fig
