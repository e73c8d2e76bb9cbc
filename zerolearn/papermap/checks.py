"""Computed against measured: the successor rows of the paper map whose status rests on a
measurement, and the test of that status.

A row says :data:`~zerolearn.papermap.base.REPRODUCED` only when every figure the package
measures for it equals what its formula computes for the same run, within the check's
stated relative tolerance; a row whose checks all agree says reproduced. The
measurements are chapter 8's own tables (:func:`zerolearn.experiments.zeropp.zeropp_table`
and :func:`zerolearn.experiments.offload.offload_table`), so the chapter prints these
checks from the runs it already made, and ``tests/test_papermap.py`` holds the rows to
them.

:func:`paper_rule_problems` holds the rows of the paper's own table to the map's status
rule: a row says :data:`~zerolearn.papermap.base.REPRODUCED` only when the package's
computation at the paper's own stated inputs holds every number the paper states, within
the tolerance the row states; a row whose computation changes an input or the scheme says
"in shape only" and names the change.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolearn.costmodel import qgz_cross_node_bytes, zeropp_cross_node_bytes
from zerolearn.papermap.base import REPRODUCED, SHAPE_ONLY, Row
from zerolearn.zeropp import DEFAULT_BLOCK as BLOCK  # chapter 8's qwZ and qgZ block: elements per fp32 scale

__all__ = ["Check", "paper_rule_problems", "status_problems", "successor_checks"]


@dataclass(frozen=True)
class Check:
    """One figure of a paper-map row: ``computed`` by the package's formula for the run,
    ``measured`` on the run; they agree when |measured - computed| <= ``tolerance`` x
    |computed| (``tolerance`` relative, 0 for bytes that must be equal)."""

    key: str
    what: str
    computed: float
    measured: float
    tolerance: float

    @property
    def agrees(self) -> bool:
        return abs(self.measured - self.computed) <= self.tolerance * abs(self.computed)


def successor_checks(zeropp_rows: list[dict], offload_rows: list[dict], *, world_size: int,
                     node_ranks: int) -> list[Check]:
    """The checks behind the successor rows, from chapter 8's measured tables.

    Args:
        zeropp_rows: :func:`~zerolearn.experiments.zeropp.zeropp_table`'s rows (one per
            option, rank 0's bytes per step by link), run on ``world_size`` ranks in nodes
            of ``node_ranks``, bf16, blocks of 256.
        offload_rows: :func:`~zerolearn.experiments.offload.offload_table`'s rows at stage 2.

    The ZeRO++ figures are ratios to plain ZeRO-3's bytes across the node boundary, so the
    link model's (Nd - N) / Nd share cancels: qwZ's forward gather against
    :func:`~zerolearn.costmodel.zeropp_cross_node_bytes`, hpZ's secondary shard (bytes)
    against Psi / N bf16 values, qgZ's gradients and all three options' total against the
    same function (ZeRO++'s count: M / 4 for qgZ), and qgZ's gradients again against
    :func:`~zerolearn.costmodel.qgz_cross_node_bytes`'s two hops. Tolerance 2% for the
    ZeRO++ ratios (a rank's shard is padded to whole blocks), 0 for offload's bytes.

    Raises:
        KeyError: a table without plain ZeRO-3's row or offload's "cpu" row.
    """
    by_option = {r["option"]: r for r in zeropp_rows}
    plain, psi = by_option["ZeRO-3"], by_option["ZeRO-3"]["psi"]

    def ratio(option: str, work: str) -> float:
        key = f"{work} inter B" if work else "inter B"
        return by_option[option][key] / plain[key]

    def formula(**opts) -> dict[str, float]:
        return zeropp_cross_node_bytes(psi, world_size, node_ranks, dtype="bf16", block=BLOCK, **opts)

    base, everything = formula(), formula(qwz=True, hpz=True, qgz=True)
    two_hops = qgz_cross_node_bytes(psi, world_size, node_ranks, hops=2, block=BLOCK)["per_gpu"]
    link_share = (world_size - node_ranks) / world_size  # of plain ZeRO-3's reduce-scatter bytes
    cpu = next(r for r in offload_rows if r["option"] == "cpu")
    return [
        Check("offload-placement", "device bytes, ZeRO-2 + cpu", cpu["device formula B"], cpu["device B"], 0.0),
        Check("offload-placement", "host bytes, ZeRO-2 + cpu", cpu["host formula B"], cpu["host B"], 0.0),
        Check("zeropp-qwz", "forward gather vs ZeRO-3", formula(qwz=True)["forward_gather"] / base["forward_gather"],
              ratio("qwZ", "forward gather"), 0.02),
        Check("zeropp-hpz", "secondary shard bytes", formula(hpz=True)["hpz_extra_bytes"],
              by_option["hpZ"]["extra bytes"], 0.02),
        Check("zeropp-qgz", "gradients vs ZeRO-3 (ZeRO++'s count)", formula(qgz=True)["gradients"] / base["gradients"],
              ratio("qgZ", "gradient"), 0.02),
        Check("zeropp-qgz-hops", "gradients vs ZeRO-3 (two hops, link model)",
              two_hops / (link_share * base["gradients"]), ratio("qgZ", "gradient"), 0.02),
        Check("zeropp-4x", "ZeRO-3 total / all three", base["total"] / everything["total"],
              1 / ratio("qwZ+hpZ+qgZ", ""), 0.02),
    ]


def status_problems(rows: list[Row], checks: list[Check]) -> list[str]:
    """What contradicts the checks: a row that says reproduced while one of its checks
    disagrees, or a row whose checks all agree that does not say reproduced. Empty when
    every checked row's status follows from its checks. Checks whose key names no row
    (``zeropp-qgz-hops``: the chapter's own computation) are not held to a status."""
    problems = []
    for row in rows:
        mine = [c for c in checks if c.key == row.key]
        if not mine:
            continue
        agree = all(c.agrees for c in mine)
        if row.status == REPRODUCED and not agree:
            bad = "; ".join(f"{c.what}: computed {c.computed:.4g}, measured {c.measured:.4g}" for c in mine
                            if not c.agrees)
            problems.append(f"{row.key} says {REPRODUCED!r} but {bad}")
        elif row.status != REPRODUCED and agree:
            problems.append(f"{row.key} says {row.status!r} while every check agrees")
    return problems


def paper_rule_problems(rows: list[Row]) -> list[str]:
    """What breaks the map's status rule, one line per row; empty when every row keeps it.

    For each row with a computation (``values``): every key of ``paper`` must be computed;
    a :data:`REPRODUCED` row needs ``paper`` numbers, nothing ``changed``, and each computed
    value holding its :class:`~zerolearn.papermap.base.Stated`; a row that ``changed`` an
    input or the scheme is not reproduced; a row in shape only whose numbers all hold at
    the paper's inputs should say reproduced."""
    problems = []
    for row in rows:
        if not row.values:
            continue
        missing = [k for k in row.paper if k not in row.values]
        if missing:
            problems.append(f"{row.key}: the paper's {missing} have no computed value")
            continue
        misses = [f"{k} = {row.values[k]:.4g} is not {s.text()}" for k, s in row.paper.items()
                  if not s.holds(row.values[k])]
        if row.status == REPRODUCED:
            if not row.paper:
                problems.append(f"{row.key} says {REPRODUCED!r} with no number of the paper's to hold")
            if row.changed:
                problems.append(f"{row.key} says {REPRODUCED!r} though the book changed {row.changed}")
            problems += [f"{row.key} says {REPRODUCED!r} but {m}" for m in misses]
        elif row.status == SHAPE_ONLY and row.paper and not row.changed and not misses:
            problems.append(f"{row.key} says {SHAPE_ONLY!r} while its numbers hold at the paper's inputs")
    return problems
