"""Turn training reports (DESIGN section 4) into the tables the book prints.

Data stays in bytes and elements; these helpers format for people only.
"""

from __future__ import annotations

from zerolearn.comm import CommLedger, OpStats
from zerolearn.memory import model as analytic
from zerolearn.tables import text_table

CATEGORIES = ("params", "grads", "optimizer_states")


def kib(n: float | None) -> str:
    """Bytes as KiB for a table cell ("-" for None)."""
    return "-" if n is None else f"{n / 1024:,.1f}"


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
