"""Chapter 1, data parallelism: the layout of the chapter's two figures (paper Sec 7.1, Fig 1).

What the chapter runs (the collectives on live ranks, naive DP, the three DP versions
against one process) is written in the notebook's cells; this module only draws what
they measured, and runs one version's watched steps (:func:`watched_steps`), so that a
cell stays one idea.
"""

from __future__ import annotations

import numpy as np


def collectives_figure(grads: list, chunks: list, gathered: list):
    """Three panels, one row per rank: each rank's gradient before, its chunk of the sum
    after reduce-scatter (at the chunk's place in the full tensor), and what it holds after
    all-gather. Arguments are per-rank tensors in rank order (what ``Ranks.pull`` returns).
    Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    world_size, numel = len(grads), len(grads[0])
    chunk = numel // world_size
    scattered = np.full((world_size, numel), np.nan)
    for rank, c in enumerate(chunks):
        scattered[rank, rank * chunk:(rank + 1) * chunk] = c.numpy()
    after = np.stack([g.numpy() for g in gathered])
    panels = {"1. before: each rank's gradient": np.stack([g.numpy() for g in grads]),
              "2. after reduce-scatter:\nrank r keeps chunk r of the sum": scattered,
              "3. after all-gather:\nevery rank holds the whole sum": after}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2), sharey=True)
    for ax, (title, grid) in zip(axes, panels.items(), strict=True):
        ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=0, vmax=after.max(), aspect="auto")
        for (row, col), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(col, row, f"{v:.0f}", ha="center", va="center", color="w" if v < 40 else "k")
        for edge in range(chunk, numel, chunk):
            ax.axvline(edge - 0.5, color="w", lw=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"element index (chunks of {chunk} elements)")
        ax.set_xticks(range(numel))
    axes[0].set_ylabel("rank")
    axes[0].set_yticks(range(world_size))
    fig.suptitle(f"All-reduce = reduce-scatter + all-gather, measured on {world_size} gloo ranks (Sec 7.1)", y=1.04)
    return fig


def redundancy_figure(dp_reports: dict, one_copy_kib: float, cats=("params", "grads", "optimizer_states")):
    """Left: the model-state KiB each rank holds, stacked by category, for every
    ``{nd: training report}``; right: the sum over ranks against Nd copies of
    ``one_copy_kib`` (the formula's 16 Psi). Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    labels = []
    for nd, report in dp_reports.items():
        for entry in report["ranks"]:
            x, bottom = len(labels), 0.0
            for j, c in enumerate(cats):
                v = entry["model_state_bytes"][c] / 1024
                left.bar(x, v, bottom=bottom, color=f"C{j}", label=c if x == 0 else None)
                bottom += v
            labels.append(f"Nd={nd}\nrank {entry['rank']}")
    left.axhline(one_copy_kib, color="k", ls="--", lw=1, label="formula (2 + 2 + K) psi, K = 12")
    left.set_xticks(range(len(labels)), labels)
    left.set_ylabel("model-state bytes held by the rank (KiB)")
    left.set_title("Each rank's bytes, measured (stage 0, bf16 Adam)")
    left.set_ylim(0, one_copy_kib * 1.35)
    left.legend(fontsize=8, loc="upper center", ncol=2)
    nds = list(dp_reports)
    totals = [sum(sum(e["model_state_bytes"].values()) for e in dp_reports[nd]["ranks"]) / 1024 for nd in nds]
    right.plot(nds, totals, "o-", label="measured, sum over ranks")
    right.plot(nds, [nd * one_copy_kib for nd in nds], "k--", label="formula, Nd x 16 psi")
    right.axhline(one_copy_kib, color="C2", lw=1, label="one copy: 16 psi")
    right.set_xlabel("data-parallel ranks Nd")
    right.set_ylabel("model-state bytes, all ranks together (KiB)")
    right.set_title("Total memory grows with Nd")
    right.set_xticks(nds)
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def watched_steps(step_fn, batch, steps: int) -> tuple[list[float], float]:
    """Run ``step_fn(*batch(step))`` for ``steps`` steps on this rank, each inside
    :func:`zerolearn.watch.watching`, so that collectives called by torch's names (naive
    DP's ``dist.all_reduce``) are booked in ``comm.LEDGER`` beside the engine's own.
    Returns the global mean loss of every step (``comm.monitor_mean`` over the ranks) and
    the median step time in seconds (the first step, which warms up, left out)."""
    import statistics
    import time

    from zerolearn import comm
    from zerolearn.watch import watching

    losses, seconds = [], []
    for step in range(steps):
        x, y = batch(step)
        t0 = time.perf_counter()
        with watching():
            loss = step_fn(x, y)
        losses.append(comm.monitor_mean(loss))  # the global mean over ranks
        seconds.append(time.perf_counter() - t0)
    return losses, statistics.median(seconds[1:] or seconds)
