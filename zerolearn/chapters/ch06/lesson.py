"""Chapter 6, at scale: the paper's tables from the formulas, measured where a CPU can.

* :func:`table1_rows` and :func:`table2_rows` recompute Table 1 and Table 2's
  theoretical column from :mod:`zerolearn.memory.model` beside the printed values.
* :func:`measure_per_rank` runs ``--simulate-world-size`` for several stages and Nd
  (rank 0 of Nd ranks in this process, see :func:`zerolearn.chapters.ch04.lesson.simulate`).
* :func:`scaling_rows` is the super-linear scaling argument of Sec 10.3 (Fig 3) on
  the cost model of :mod:`zerolearn.costmodel`.
* :func:`trillion_days` is Sec 9's estimate of the time to train a trillion parameters.
* :func:`table1_figure` and :func:`scaling_figure` draw the chapter's two plots, so that
  its cells keep to the measurement.

The chapter's exercises (``06.max_psi``, ``06.fewest_gpus``) are beside this module, in
:mod:`zerolearn.chapters.ch06`.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from zerolearn import figures
from zerolearn.chapters.ch04.lesson import simulate
from zerolearn.config import TrainConfig
from zerolearn.costmodel import EfficiencyCurve, Hardware, throughput_per_gpu
from zerolearn.memory.fit import gpt_params
from zerolearn.memory.model import (
    GB,
    STAGE_NAMES,
    TABLE1_GB,
    TABLE2_THEORETICAL_B,
    V100_BYTES,
    max_model_params,
    model_state_bytes,
)

__all__ = ["DGX2", "GPT_60B", "measure_per_rank", "scaling_figure", "scaling_rows", "table1_figure", "table1_rows",
           "table2_rows", "trillion_days"]

DGX2 = Hardware(tflops_achieved=40, intra_node_GBps=300, inter_node_GBps=800 / 8 / 16, gpus_per_node=16)
"""The paper's cluster as the cost model sees it: 25 DGX-2 nodes of 16 V100s (Sec 10.1);
inside a node NVSwitch, whose 300 GB/s per link (Sec 10.2) the model takes as each GPU's
bandwidth; 40 TFLOP/s achieved per GPU (Sec 10.2: over 38). Between nodes the paper gives
800 Gbps of bandwidth per node (Sec 10.1), which the model shares among its 16 GPUs:
800 / 8 / 16 = 6.25 GB/s per GPU. (Sec 10.2 compares links: 300 GB/s per NVSwitch link
against 12.5 GB/s per InfiniBand EDR link, 24x; per GPU, as modelled here, 48x.)"""

GPT_60B = {"layers": 75, "hidden": 8192}
"""A GPT-like shape of about 60B parameters (12 x 75 x 8192^2 = 60.4e9), the size of Fig 3.
The shape is the book's choice: the paper lists its runs' shapes in Table 6, an image in
its text."""


def table1_rows(psi: int) -> list[dict]:
    """Table 1 for one model size: per Nd, each stage's GB per device, computed and printed.

    Computed with ``model_state_bytes(psi, nd, stage, k=12)`` (Sec 5, Fig 1); printed
    from ``TABLE1_GB``. Returns ``{"nd", "computed": [P_os, P_os+g, P_os+g+p],
    "printed": [...]}`` per Nd, in GB (1e9 bytes).
    """
    return [{"nd": nd, "computed": [model_state_bytes(psi, nd, s)["total"] / GB for s in (1, 2, 3)],
             "printed": list(printed)} for nd, printed in TABLE1_GB[psi].items()]


def table2_rows() -> list[dict]:
    """Table 2's theoretical column: the largest Psi per stage on 32 GB V100s.

    ``max_model_params(V100_BYTES, nd=GPUs / MP, stage, nm=MP)`` (model states only,
    as the paper's theoretical column). Returns ``{"mp", "gpus", "computed": [stage
    0-3], "printed": [...]}`` per row, in billions of parameters.
    """
    return [{"mp": mp, "gpus": gpus,
             "computed": [max_model_params(V100_BYTES, gpus // mp, s, nm=mp) / 1e9 for s in range(4)],
             "printed": list(printed)} for (mp, gpus), printed in TABLE2_THEORETICAL_B.items()]


def measure_per_rank(stages: tuple[int, ...], nds: tuple[int, ...], config: TrainConfig) -> list[dict]:
    """Model-state bytes of rank 0 at each (stage, Nd), measured with ``--simulate-world-size``.

    One sequence per rank (``global_batch_size`` = Nd); ``config`` sets the model.
    Returns ``{"stage", "nd", "psi", "padding", "bytes"}`` per run (bytes: params +
    grads + optimizer states, measured from the tensors rank 0 holds).
    """
    rows = []
    for stage in stages:
        for nd in nds:
            report = simulate(stage, nd, config.replace(global_batch_size=nd))
            entry = report["ranks"][0]
            rows.append({"stage": stage, "nd": nd, "psi": report["num_params"],
                         "padding": entry["padding_elements"], "bytes": sum(entry["model_state_bytes"].values())})
    return rows


def scaling_rows(gpus: list[int], stage: int = 2, nm: int = 16, curve: EfficiencyCurve | None = None,
                 hw: Hardware = DGX2, seq_len: int = 1024) -> list[dict]:
    """Per-GPU and aggregate throughput of the 60B model as GPUs grow (Sec 10.3, Fig 3).

    Each GPU count runs Nd = GPUs / Nm data-parallel replicas of an Nm-way model-
    parallel model at the largest batch per GPU that fits 32 GB with activation
    checkpointing (``costmodel.throughput_per_gpu``). ``curve`` (default: half of a
    60 TFLOP/s peak at 4 sequences per GPU) is an assumption, not the paper's data, and
    ``nm`` = 16 (one DGX-2 node) is the book's choice, as is the shape :data:`GPT_60B`.
    Returns ``{"gpus", "nd", "batch", "tflops_per_gpu", "aggregate_pflops"}`` per row.
    """
    curve = curve or EfficiencyCurve(peak_tflops=60, b_half=4)
    psi = gpt_params(**GPT_60B)
    rows = []
    for n in gpus:
        t = throughput_per_gpu(psi, V100_BYTES, stage, n // nm, hw, curve, seq_len=seq_len, nm=nm, **GPT_60B)
        rows.append({"gpus": n, "nd": n // nm, "batch": t.batch_per_gpu, "tflops_per_gpu": t.tflops_per_gpu,
                     "aggregate_pflops": n * t.tflops_per_gpu / 1000})
    return rows


def table1_figure(measured: list[dict], nds: tuple[int, ...]) -> Figure:
    """Table 1's trend for stages 1-3: memory per device over DP's 16 Psi against Nd, as
    the formula (lines, Sec 5), as ``measured`` (dots, rows of :func:`measure_per_rank`)
    and as Table 1 prints it for Psi = 7.5B at ``nds`` (crosses; DP holds 120 GB)."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    nds_line = [2**i for i in range(11)]
    psi = measured[0]["psi"]
    for stage in (1, 2, 3):
        color = figures.STAGE_COLORS[stage]
        ax.plot(nds_line, [model_state_bytes(1, nd, stage)["total"] / 16 for nd in nds_line], color=color,
                label=f"{stage} {STAGE_NAMES[stage]}: formula")
        ms = [m for m in measured if m["stage"] == stage]
        ax.plot([m["nd"] for m in ms], [m["bytes"] / (16 * psi) for m in ms], "o", color=color,
                label=f"{stage}: measured, Psi = {psi:,}")
        ax.plot(nds, [TABLE1_GB[7_500_000_000][nd][stage - 1] / 120 for nd in nds], "x", color="black", markersize=8)
    ax.plot([], [], "x", color="black", label="Table 1 as printed (7.5B)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel degree Nd (GPUs)")
    ax.set_ylabel("memory per device / DP memory (16 Psi bytes)")
    ax.set_title("Table 1 trend: formula, measured shards, printed values")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def scaling_figure(scaling: dict[int, list[dict]], gpus: list[int]) -> Figure:
    """Fig 3's argument (Sec 10.3) from :func:`scaling_rows` per stage (1 and 2 drawn):
    throughput per GPU (TFLOP/s, left) and aggregate (PFLOP/s, right) against the GPU
    count, with the line of linear scaling from stage 2's first point."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for stage in (1, 2):
        style = dict(color=figures.STAGE_COLORS[stage], label=f"{stage} {STAGE_NAMES[stage]}")
        left.plot(gpus, [r["tflops_per_gpu"] for r in scaling[stage]], "o-", **style)
        right.plot(gpus, [r["aggregate_pflops"] for r in scaling[stage]], "o-", **style)
    base = scaling[2][0]["aggregate_pflops"]
    right.plot(gpus, [base * g / gpus[0] for g in gpus], "--", color="gray",
               label=f"linear from {gpus[0]} GPUs (stage 2)")
    left.set_ylabel("throughput per GPU (TFLOP/s)")
    left.set_title("Per GPU: rises with the GPU count")
    right.set_ylabel("aggregate throughput (PFLOP/s)")
    right.set_title("Aggregate: above linear (Fig 3)")
    for ax in (left, right):
        ax.set_xlabel("GPUs (Nd x MP 16)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def trillion_days(bert_minutes: float = 67, bert_psi: float = 330e6, psi: float = 1e12) -> float:
    """Sec 9's estimate of the days to train ``psi`` parameters on the 1024 GPUs on which
    BERT-Large (``bert_psi``, 330M parameters) trains in ``bert_minutes`` (67): the compute
    grows with the parameters, psi / bert_psi (about 3000x for 1T), at the same sequence
    length and number of samples. Returns days (about 141 for the defaults; the paper
    rounds to 140 and expects over a year with more data)."""
    return bert_minutes * psi / bert_psi / (60 * 24)
