"""Chapter 4, ZeRO-3 (P_os+g+p): the runs the notebook and chapter 6 reuse.

* :func:`all_stages` trains stages 0-3 one after the other on the ranks that
  :func:`zerolearn.dist.launch` spawned (one spawn instead of four).
* :func:`simulate` is ``python -m zerolearn.train --simulate-world-size N`` run in
  this process: rank 0 of N ranks, real shards, no data moved.
* :func:`table1_rows` runs :func:`simulate` at several Nd and stages and lays out
  section 7's two tables: bytes beside the formula, and ratios beside Table 1's.
"""

from __future__ import annotations

from zerolearn.config import TrainConfig
from zerolearn.memory.model import STAGE_NAMES, TABLE1_GB, model_state_bytes
from zerolearn.train import train, train_here

__all__ = ["all_stages", "simulate", "table1_rows"]


def all_stages(config: TrainConfig, stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    """Train each of ``stages`` in turn on this process group, otherwise with ``config``.

    Runs on every rank spawned by :func:`zerolearn.dist.launch`; returns the reports
    of :func:`zerolearn.train.train` (docs/ARCHITECTURE.md, "The training run"), one per stage, in order.
    """
    return [train(config.replace(stage=stage)) for stage in stages]


def simulate(stage: int, nd: int, config: TrainConfig) -> dict:
    """``python -m zerolearn.train --stage S --simulate-world-size ND ...`` in this process.

    This process plays rank 0 of ``nd`` ranks on torch's "fake" process group: every
    flat buffer is padded and sharded for ``nd`` ranks, so the bytes measured are
    those rank 0 of a real ``nd``-rank job would hold; collectives move no data, so
    the losses mean nothing. Returns the training report (``ranks`` holds rank 0).
    """
    return train_here(config.replace(stage=stage, simulate_world_size=nd))



def table1_rows(config: TrainConfig, nds: tuple[int, ...] = (8, 64, 1024),
                stages: tuple[int, ...] = (1, 2, 3)) -> tuple[int, list[list], list[list]]:
    """Rank 0's model-state bytes of ``config``'s model at each Nd and ZeRO stage, by :func:`simulate`
    (one sequence per rank), laid out for :func:`zerolearn.tables.text_table` (Sec 5, Table 1).

    Returns ``(psi, held, ratios)``. ``held``: per (nd, stage), ``[nd, stage, measured bytes,
    formula bytes, padding elements, formula at Psi + padding]`` (replicated buffers hold all
    of the padding, shards 1/Nd of it, so the formula at Psi + padding is exact). ``ratios``:
    ``[nd, stage, measured / DP's 16 Psi, Table 1's ratio at 7.5B ("-" where Table 1 lacks the Nd)]``.
    """
    held, ratios = [], []
    for nd in nds:
        for stage in stages:
            r = simulate(stage, nd, config.replace(global_batch_size=nd))
            entry, psi = r["ranks"][0], r["num_params"]
            measured, pad = sum(entry["model_state_bytes"].values()), entry["padding_elements"]
            name = f"{stage} {STAGE_NAMES[stage]}"
            held.append([nd, name, measured, f"{model_state_bytes(psi, nd, stage)['total']:,.0f}", pad,
                         f"{model_state_bytes(psi + pad, nd, stage)['total']:,.0f}"])
            table1 = TABLE1_GB[7_500_000_000].get(nd)
            ratios.append([nd, name, f"{measured / (16 * psi):.4f}",
                           "-" if table1 is None else f"{table1[stage - 1] / 120:.4f}"])
    return psi, held, ratios
