"""Turn training reports (DESIGN section 4) into the tables the book prints.

Data stays in bytes and elements; these helpers format for people only.
"""

from __future__ import annotations

from zerolearn.comm import CommLedger, OpStats
from zerolearn.engines import STAGE_NAMES
from zerolearn.memory import model as analytic

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
    row = {"stage": cfg["stage"], "name": STAGE_NAMES[cfg["stage"]], "loss": report["losses"][-1],
           "padding": entry.get("padding_elements", 0),
           "psi_per_step": volume_per_step(entry, steps) / psi,
           "psi_per_step_theory": analytic.comm_volume_elements(psi, cfg["stage"]) / psi,
           "step_ms": report["step_seconds_median"] * 1e3, "peak_bytes": entry["peak_bytes"]}
    for c in CATEGORIES:
        row[c] = entry["model_state_bytes"][c]
        row[c + "_formula"] = report["analytic"]["model_state_bytes"][c]
    return row


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`stage_row` rows (KiB per rank, Psi per step)."""
    head = (f"{'stage':<20} {'final loss':>10} | {'params KiB':>19} | {'grads KiB':>19} | "
            f"{'optim states KiB':>19} | {'comm Psi/step':>13} | {'step ms':>7}")
    sub = (f"{'':<20} {'':>10} | {'measured':>9} {'formula':>9} | {'measured':>9} {'formula':>9} | "
           f"{'measured':>9} {'formula':>9} | {'meas':>6} {'theory':>6} | {'median':>7}")
    lines = [head, sub, "-" * len(head)]
    for r in rows:
        cells = " | ".join(f"{kib(r[c]):>9} {kib(r[c + '_formula']):>9}" for c in CATEGORIES)
        lines.append(f"{r['stage']} {r['name']:<18} {r['loss']:>10.6f} | {cells} | "
                     f"{r['psi_per_step']:>6.3f} {r['psi_per_step_theory']:>6.1f} | {r['step_ms']:>7.1f}")
    return "\n".join(lines)


def format_rank_table(report: dict) -> str:
    """Per-rank table of one run: bytes held (KiB) and elements moved per step by collective."""
    steps = len(report["losses"])
    formula = report["analytic"]["model_state_bytes"]
    head = (f"{'rank':>4} | {'params KiB':>10} {'grads KiB':>10} {'optim KiB':>10} | "
            f"{'all_reduce':>10} {'red_scatter':>11} {'all_gather':>10} | {'Psi/step':>8} | {'peak KiB':>9}")
    lines = [head, "-" * len(head)]
    for entry in report["ranks"]:
        held = entry["model_state_bytes"]
        per_step = {op: entry["comm"][op]["elements"] // steps for op in ("all_reduce", "reduce_scatter",
                                                                         "all_gather")}
        lines.append(f"{entry['rank']:>4} | {kib(held['params']):>10} {kib(held['grads']):>10} "
                     f"{kib(held['optimizer_states']):>10} | {per_step['all_reduce']:>10,} "
                     f"{per_step['reduce_scatter']:>11,} {per_step['all_gather']:>10,} | "
                     f"{volume_per_step(entry, steps) / report['num_params']:>8.3f} | "
                     f"{kib(entry['peak_bytes']):>9}")
    stage = report["config"]["stage"]
    lines.append(f"{'paper':>4} | {kib(formula['params']):>10} {kib(formula['grads']):>10} "
                 f"{kib(formula['optimizer_states']):>10} | {'':>34} | "
                 f"{analytic.comm_volume_elements(1, stage):>8.3f} |")
    return "\n".join(lines)
