"""Chapter 3, ZeRO-2 (P_os+g): gradient accumulation written two ways, measured.

The chapter writes the blog's flawed ZeRO-2 (``BlogZero2``, on chapter 2's
:class:`zerolearn.chapters.ch02.lesson.NaiveZero1`) in its own cells. What stays here
is :func:`accumulation_tradeoff`, run on spawned ranks: ZeRO-2 with a backward per
micro-batch (a reduce-scatter each, only the shard kept) against ``engine.no_sync()``
(one reduce-scatter per step, the whole gradient kept until then). The layout of the
chapter's wider tables and plots is here too (:func:`keeps_tables`,
:func:`grads_timeline_figure`, :func:`bucket_figure`), so that its cells show the
computation.
"""

from __future__ import annotations

import torch.nn.functional as F

from zerolearn import comm
from zerolearn.flat import make_buckets
from zerolearn.memory import model as analytic
from zerolearn.tables import kib, text_table


def accumulation_tradeoff(micro_batches: int = 4, steps: int = 2) -> dict[str, dict]:
    """ZeRO-2 with gradient accumulation written two ways, on this process group.

    ``"backward each micro-batch"``: plain ``engine.backward`` per micro-batch, so each
    one is reduce-scattered at once and added into the rank's shard; ``"no_sync"``:
    the first micro-batches inside ``engine.no_sync()``, so gradients add up locally
    and only the last backward reduces. The chapter's GPT (d_model 128, 2 blocks, sequence
    16), a global batch of 16 sequences, fp32 Adam, buckets of 0.25 MiB.

    Returns per way: ``losses`` (global mean per step), ``reduce_scatter_calls`` and
    ``reduce_scatter_elements`` per step, ``peak_grad_bytes`` (most gradient bytes
    held at once, measured), ``psi``.
    """
    from zerolearn import data
    from zerolearn import dist as zdist
    from zerolearn.engines import make_engine
    from zerolearn.models import GPTConfig, build_model

    ctx, gpt = zdist.context(), GPTConfig(seq_len=16, n_layer=2, d_model=128)
    out = {}
    for way in ("backward each micro-batch", "no_sync"):
        engine = make_engine(2, build_model("gpt", 0, gpt=gpt), optimizer="adam", lr=1e-3, bucket_mb=0.25)
        comm.LEDGER.reset()
        losses = []
        for step in range(steps):
            x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in data.gpt_batch(step, 16, gpt.seq_len))
            local = 0.0
            for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
                loss = F.cross_entropy(engine(xm).float().flatten(0, 1), ym.flatten()) / micro_batches
                if way == "no_sync" and i < micro_batches - 1:
                    with engine.no_sync():
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                local += loss.item()
            engine.step()
            engine.zero_grad()
            losses.append(comm.monitor_mean(local))
        rs = comm.LEDGER.as_dict()["reduce_scatter"]
        out[way] = {"losses": losses, "reduce_scatter_calls": rs["calls"] // steps,
                    "reduce_scatter_elements": rs["elements"] // steps,
                    "peak_grad_bytes": engine.peak_grad_bytes, "psi": engine.psi}
    return out



def keeps_tables(runs: list[tuple[int, dict]], named: list, psi: int, max_in_flight: int) -> tuple[str, str]:
    """Section 3's two tables for ``runs`` [(Nd, report)], rank 0.

    The first: KiB of params, grads and optimizer states held after backward, measured
    and by the paper's formula (unpadded Psi). The second: padding elements, the most
    gradient bytes alive during backward, ZeRO-1's full gradient, the largest bucket
    (``named``: the model's (name, parameter) in the engine's order) and the peak's excess
    over the shards in units of that bucket, which the engine bounds by
    ``max_in_flight + 2``.
    """
    keeps, peaks = [], []
    for nd, rep in runs:
        entry, formula, dtype = rep["ranks"][0], rep["analytic"]["model_state_bytes"], rep["config"]["dtype"]
        held = entry["model_state_bytes"]
        keeps.append([f"{nd} {dtype}", *(kib(d[c]) for c in ("params", "grads", "optimizer_states")
                                          for d in (held, formula))])
        width = analytic.dtype_bytes(dtype)
        groups = make_buckets(named, int(rep["config"]["bucket_mb"] * 2**20), width, nd, 0)
        largest = max(g.padded_numel for g in groups) * width
        peaks.append([f"{nd} {dtype}", entry["padding_elements"], kib(entry["peak_grad_bytes"]), kib(width * psi),
                      kib(largest), f"{(entry['peak_grad_bytes'] - held['grads']) / largest:.2f}",
                      max_in_flight + 2])
    keeps_t = text_table(["Nd dtype", "params KiB", "formula", "grads KiB", "formula", "optim KiB", "formula"], keeps)
    peaks_t = text_table(["Nd dtype", "padding", "peak grads\nKiB", "ZeRO-1 grads\nKiB", "largest\nbucket KiB",
                          "(peak - shards)\n/ bucket", "bound"], peaks)
    return keeps_t, peaks_t


def _phase_spans(timeline: list) -> list[list]:
    """[phase, first event, last event] of each run of one phase in a ledger timeline."""
    spans: list[list] = []
    for i, event in enumerate(timeline):
        if not spans or spans[-1][0] != event[1]:
            spans.append([event[1], i, i])
        spans[-1][2] = i
    return spans


def grads_timeline_figure(timelines: dict[int, list], psi: int):
    """Section 3's plot: the ``grads`` category and all tracked memory over one step, per
    stage (``timelines``: stage -> the ledger's timeline of rank 0), phases shaded. Returns
    the figure."""
    import matplotlib.pyplot as plt

    shade = {"forward": "#e8e8ff", "backward": "#e8ffe8", "step": "#ffe8e8"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, 6))
    for ax, (stage, timeline) in zip(axes, timelines.items(), strict=True):
        for phase, a, b in _phase_spans(timeline):
            if phase in shade:  # "setup": registering existing tensors, freeing the graph
                ax.axvspan(a, b, color=shade[phase], lw=0)
                ax.text((a + b) / 2, 1.02, phase, transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
        ax.plot([e[3]["grads"] / 1024 for e in timeline], color="C3", label="grads")
        ax.plot([e[2] / 1024 for e in timeline], color="k", lw=0.8, label="all tracked memory")
        ax.axhline(4 * psi / 1024, color="C3", ls=":", lw=1, label=r"full fp32 gradient $4\Psi$")
        ax.set_ylabel("KiB on rank 0")
        ax.set_title(f"ZeRO-{stage}, 4 ranks, 0.2 MiB buckets", pad=14)
    axes[0].legend(fontsize=8, loc="center left")
    axes[-1].set_xlabel("allocation and free events during the last step (event index)")
    fig.suptitle("Memory over one training step, by the memory ledger")
    fig.tight_layout()
    plt.close(fig)
    return fig


def bucket_figure(buckets: tuple[float, ...], sweep: dict, psi: int, nd: int = 4):
    """Section 5's plot: peaks on rank 0 against bucket size (``sweep[(stage, bucket_mb)]``:
    the reports), fp32, with ZeRO-1's full gradient and ZeRO-2's shards. Returns the figure."""
    import matplotlib.pyplot as plt

    def rank0(stage: int, key: str) -> list[float]:
        return [sweep[(stage, b)]["ranks"][0][key] / 1024 for b in buckets]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(buckets, rank0(1, "peak_bytes"), "o--", color="C0", label="ZeRO-1 peak, all memory")
    ax.plot(buckets, rank0(2, "peak_bytes"), "o-", color="C1", label="ZeRO-2 peak, all memory")
    ax.plot(buckets, rank0(2, "peak_grad_bytes"), "s-", color="C3", label="ZeRO-2 peak, gradients only")
    ax.axhline(4 * psi / 1024, color="C3", ls=":", label=r"ZeRO-1 gradients: $4\Psi$ bytes")
    ax.axhline(4 * psi / nd / 1024, color="C3", ls="-.", lw=0.8, label=r"ZeRO-2 shards: $4\Psi/N_d$ bytes")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size --bucket-mb (MiB)")
    ax.set_ylabel("peak on rank 0 (KiB)")
    ax.set_title(f"GPT on {nd} ranks, fp32: peak memory against bucket size")
    ax.legend(fontsize=8)
    plt.close(fig)
    return fig
