"""The training report (docs/ARCHITECTURE.md, "The training run"): built at the end of a run, and turned into tables.

:func:`make_report` gathers every rank's measurements (bytes held per category,
peak memory, traffic, residual states) beside the paper's formulas for the same
run; the other helpers format reports for people (data stays in bytes and elements).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from zerolearn import comm, compat
from zerolearn.comm import CommLedger, OpStats
from zerolearn.memory import model as analytic
from zerolearn.residual import setup as residual_setup
from zerolearn.tables import kib, text_table

if TYPE_CHECKING:
    from zerolearn.config import TrainConfig
    from zerolearn.train import Run, Watched

CATEGORIES = ("params", "grads", "optimizer_states")


def saved_config(config: TrainConfig) -> dict:
    """The options a report and a checkpoint keep: every field but ``quiet`` (progress bars)."""
    return {k: v for k, v in config.as_dict().items() if k != "quiet"}


def analytic_bytes(config: TrainConfig, psi: int, nd: int) -> dict[str, float]:
    """The paper's model-state bytes per rank for this run (Sec 5, Fig 1)."""
    k = analytic.optimizer_k(config.optimizer, config.dtype, momentum=config.momentum > 0)
    width = analytic.dtype_bytes(config.dtype)
    states = analytic.model_state_bytes(psi, nd, config.stage, k=k, param_bytes=width, grad_bytes=width)
    return {key: states[key] for key in ("params", "grads", "optimizer_states")}


def rank_entry(run: Run, record: Watched) -> dict:
    """This rank's entry of the report: bytes held, peak, memory, traffic, residual states."""
    ctx, engine, ledger = run.ctx, run.engine, record.ledger
    held = engine.model_state_bytes()
    memory = ledger.summary() if ledger is not None else {"peak_bytes": None}  # None: no step left to run
    if ledger is not None and getattr(engine, "offload", None) is not None:
        memory["by_location"] = ledger.by_location()  # device and host memory apart (offload)
    if run.config.memory_timeline and ledger is not None:
        memory["timeline"] = [[e.index, e.phase, e.total, e.by_category] for e in ledger.timeline]
    cuda = ctx.device.type == "cuda"
    return {"rank": ctx.rank,
            "model_state_bytes": {"params": held["params"], "grads": record.grads_bytes,
                                  "optimizer_states": held["optimizer_states"]},
            # CUDA: the allocator's peak over the run; CPU: the ledger's over the last step.
            "peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if cuda else memory["peak_bytes"],
            "memory": memory,
            "comm": comm.LEDGER.as_dict(),
            "padding_elements": engine.padding,
            "peak_grad_bytes": engine.peak_grad_bytes,
            "residual": residual_setup.report_entry(run.zero_r, record.checkpoints, engine.temp_buffer_peak_bytes,
                                                    record.activations, ctx.device),
            "comm_by_tag": comm.LEDGER.by_tag(),
            **({"comm_by_link": link_entry()} if comm.node_ranks() is not None else {})}


def link_entry() -> dict:
    """This rank's bytes per node boundary since the ledger's reset (every step of the run):
    ``{"intra": bytes, "inter": bytes, "by_work": {doing: {"intra": bytes, "inter": bytes}}}``,
    under :mod:`zerolearn.comm`'s link model (:func:`zerolearn.comm.set_nodes`: a call on p
    ranks of B bytes exchanges B / p with each peer; ZeRO++, arXiv 2306.10209 Sec 3, counts
    the inter-node part). ``doing`` is the kind of work of :func:`zerolearn.comm.unit`
    (``"forward: gather"``, ``"backward: gather"``, ``"backward: reduce"``, ...)."""
    by_work = {doing: dict(moved) for doing, moved in sorted(comm.LEDGER.links.items())}
    return {**comm.LEDGER.by_link(), "by_work": by_work}


def make_report(run: Run, record: Watched) -> dict:
    """The run's report (docs/ARCHITECTURE.md, "The training run"), the same on every rank
    (gathers every rank's entry)."""
    c, ctx, nd = run.config, run.ctx, run.zero_r.groups.nd
    mine = rank_entry(run, record)
    simulated = ctx.backend == "fake"
    return {"config": saved_config(c),
            "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "torch": compat.TORCH_VERSION, "num_params": run.engine.psi, "first_step": run.first_step,
            "simulated": simulated,
            # Simulated: this process is rank 0 and the only one measured.
            "losses": record.losses, "ranks": [mine] if simulated else comm.gather_objects(mine),
            "data_parallel": nd, "tensor_parallel": c.tensor_parallel, "node_size": c.node_size,
            "analytic": {"model_state_bytes": analytic_bytes(c, run.engine.psi, nd),
                         "residual": residual_setup.analytic_entry(c, nd)},
            "step_seconds_median": statistics.median(record.seconds) if record.seconds else 0.0}


def volume_per_step(rank_entry: dict, steps: int) -> float:
    """Measured elements per step in the paper's count (Sec 7.1) for one rank's ``comm``."""
    ledger = CommLedger()
    for op, stats in rank_entry["comm"].items():
        ledger.ops[op] = OpStats(stats["calls"], stats["elements"], stats["bytes"])
    return ledger.volume_elements() / steps


def stage_row(report: dict, rank: int = 0) -> dict:
    """One row of the tour table: measured and formula side by side for ``rank``."""
    cfg, psi, entry = report["config"], report["num_params"], report["ranks"][rank]
    steps = len(report["losses"])
    row = {"stage": cfg["stage"], "name": analytic.stage_title(cfg["stage"]), "loss": report["losses"][-1],
           "padding": entry.get("padding_elements", 0),
           "psi_per_step": volume_per_step(entry, steps) / psi,
           "psi_per_step_theory": analytic.comm_volume_elements(psi, cfg["stage"]) / psi,
           "step_ms": report["step_seconds_median"] * 1e3, "peak_bytes": entry["peak_bytes"]}
    for c in CATEGORIES:
        row[c] = entry["model_state_bytes"][c]
        row[c + "_formula"] = report["analytic"]["model_state_bytes"][c]
    return row


def format_table(rows: list[dict]) -> str:
    """The tour's table of :func:`stage_row` rows: KiB per rank measured and by formula, Psi per step."""
    header = ["stage", "final loss", "params KiB\nmeasured", "\nformula", "grads KiB\nmeasured", "\nformula",
              "optim states KiB\nmeasured", "\nformula", "comm Psi/step\nmeasured", "\ntheory", "step ms\nmedian"]
    body = [[f"{r['stage']} {r['name']}", f"{r['loss']:.6f}",
             *(kib(r[k]) for c in CATEGORIES for k in (c, c + "_formula")),
             f"{r['psi_per_step']:.3f}", f"{r['psi_per_step_theory']:.1f}", f"{r['step_ms']:.1f}"] for r in rows]
    return text_table(header, body, align=["left", *["right"] * (len(header) - 1)])


def format_rank_table(report: dict) -> str:
    """Per-rank table of one run: bytes held (KiB) and elements moved per step by collective,
    then the paper's row (model states by formula, Psi per step of the stage)."""
    steps = len(report["losses"])
    formula = report["analytic"]["model_state_bytes"]
    header = ["rank", "params KiB", "grads KiB", "optim KiB", "all_reduce", "red_scatter", "all_gather",
              "Psi/step", "peak KiB"]
    body = []
    for entry in report["ranks"]:
        held = entry["model_state_bytes"]
        per_step = [entry["comm"][op]["elements"] // steps for op in ("all_reduce", "reduce_scatter", "all_gather")]
        body.append([entry["rank"], *(kib(held[c]) for c in CATEGORIES), *per_step,
                     f"{volume_per_step(entry, steps) / report['num_params']:.3f}", kib(entry["peak_bytes"])])
    stage = report["config"]["stage"]
    body.append(["paper", *(kib(formula[c]) for c in CATEGORIES), "", "", "",
                 f"{analytic.comm_volume_elements(1, stage):.3f}", ""])
    return text_table(header, body)
