"""ZeRO++ measured: traffic per "node" boundary, step time and loss for each option.

:func:`zeropp_table` trains the book's GPT under ZeRO-3 on spawned gloo ranks (one
machine, cut into "nodes" of ``node_ranks`` ranks: :func:`zerolearn.comm.set_nodes`), once
per option of ZeRO++ (Wang et al., arXiv 2306.10209): plain stage 3, qwZ (int8 weight
gathers, Sec 3.1), hpZ (secondary shards inside the node, Sec 3.2), qgZ (int4 two-hop
gradient all-to-all, Sec 3.3), and all three. Every run starts from the same weights and
trains on the same global batches; a row says what one rank (rank 0) moved per step,
split intra / inter node and by collective, beside the plain run.

    .venv/bin/python -m zerolearn.experiments.zeropp      # prints the table (4 ranks, 2 nodes)
"""

from __future__ import annotations

import sys

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.engines import Zero3Engine
from zerolearn.experiments._gpt import LR, check_run, small_gpt, train_steps
from zerolearn.tables import kib, text_table

OPTIONS: dict[str, dict] = {
    "ZeRO-3": {},
    "qwZ": {"qwz_block": 256},
    "hpZ": {"hpz": True},
    "qgZ": {"qgz": True},
    "qwZ+hpZ+qgZ": {"qwz_block": 256, "hpz": True, "qgz": True},
}
WORK = {"forward gather": "forward: gather", "backward gather": "backward: gather", "gradient": "backward: reduce"}


def train_option(options: dict, node_ranks: int, steps: int, d_model: int, n_layer: int = 2,
                 optimizer: str = "adam", lr: float = LR, dtype: str = "bf16") -> dict:
    """On every rank of the current process group: train ``steps`` steps of ZeRO-3 with the
    ZeRO++ ``options`` (keywords of :class:`Zero3Engine`), nodes of ``node_ranks`` ranks,
    working precision ``dtype`` (bf16 by default: the 2-byte gathers qwZ halves).

    Returns (this rank's): ``losses`` (global mean per step), ``params`` (full fp32
    state dict after training), ``bytes`` per kind of work (``WORK``) per step,
    ``{"intra": bytes, "inter": bytes}``, ``step_s`` (median step time after the first, seconds),
    ``secondary_bytes`` (hpZ's secondary shards at most, bytes), ``psi``.
    """
    engine = Zero3Engine(small_gpt(d_model, n_layer), optimizer=optimizer, lr=lr, dtype=dtype,
                         node_ranks=node_ranks, **options)
    previous = comm.node_ranks()
    comm.set_nodes(node_ranks)
    comm.LEDGER.reset()
    try:
        losses, step_s = train_steps(engine, steps)
        moved = {name: {k: v // steps for k, v in comm.LEDGER.by_link(doing).items()} for name, doing in WORK.items()}
    finally:
        comm.set_nodes(previous)
    return {"losses": losses, "params": engine.full_state_dict(), "bytes": moved,
            "step_s": step_s, "secondary_bytes": engine.zpp.peak_secondary_bytes,
            "psi": engine.psi}


def _rows(node_ranks: int, steps: int, d_model: int) -> list[dict]:
    runs = {name: train_option(opts, node_ranks, steps, d_model) for name, opts in OPTIONS.items()}
    plain = runs["ZeRO-3"]
    rows = []
    for name, run in runs.items():
        row = {"option": name}
        for work, moved in run["bytes"].items():
            row[f"{work} intra B"], row[f"{work} inter B"] = moved["intra"], moved["inter"]
        row["inter B"] = sum(m["inter"] for m in run["bytes"].values())
        row["step ms"] = run["step_s"] * 1e3
        row["max |loss diff|"] = max(abs(a - b) for a, b in zip(run["losses"], plain["losses"], strict=True))
        row["max |param diff|"] = max((run["params"][n] - p).abs().max().item() for n, p in plain["params"].items())
        row["extra bytes"] = run["secondary_bytes"]
        row["psi"] = run["psi"]
        rows.append(row)
    return rows


def zeropp_table(world_size: int = 4, node_ranks: int = 2, steps: int = 3, d_model: int = 64) -> list[dict]:
    """One row per option (plain ZeRO-3, qwZ, hpZ, qgZ, all three), measured on
    ``world_size`` spawned gloo ranks in nodes of ``node_ranks``, as rank 0 sees it: a GPT
    of 2 layers and width ``d_model`` in bf16, Adam (lr 1e-2), ``steps`` steps of a global
    batch of 8 sequences of 32 bytes, qwZ and qgZ with 256 elements per scale.

    Row keys: ``option``; for each of ``forward gather``, ``backward gather``,
    ``gradient``: ``"<work> intra B"`` and ``"<work> inter B"``, bytes this rank moved per
    step under :mod:`zerolearn.comm`'s link model; ``inter B`` (their inter-node sum);
    ``step ms`` (median step, milliseconds, this machine); ``max |loss diff|`` (largest
    difference of the global mean loss from plain ZeRO-3's over the steps) and
    ``max |param diff|`` (largest element difference of the trained fp32 parameters);
    ``extra bytes`` (hpZ's secondary shards at most, bytes; Psi / node_ranks elements of
    the working dtype, plus padding); ``psi``.

    Raises:
        ConfigError: ``world_size``, ``steps`` or ``d_model`` not an integer >= 1 (d_model
            even), ``node_ranks`` not dividing ``world_size``, ``world_size`` not dividing
            the batch of 8.
    """
    from zerolearn.zeropp import check_nodes

    check_run(world_size, steps, d_model)
    check_nodes(node_ranks, world_size)
    return zdist.launch(_rows, world_size, node_ranks, steps, d_model)[0]


def format_zeropp_table(rows: list[dict]) -> str:
    """The table as text: KiB per step intra / inter node per collective, step time, differences."""
    header = ["option", "fwd gather KiB\nintra / inter", "bwd gather KiB\nintra / inter",
              "gradient KiB\nintra / inter", "inter KiB\nper step", "step ms", "max |loss|\ndiff",
              "max |param|\ndiff", "extra KiB\n(hpZ)"]
    body = [[r["option"], *(f"{kib(r[f'{w} intra B'])} / {kib(r[f'{w} inter B'])}" for w in WORK),
             kib(r["inter B"]), f"{r['step ms']:.0f}", f"{r['max |loss diff|']:.1e}",
             f"{r['max |param diff|']:.1e}", kib(r["extra bytes"])] for r in rows]
    return text_table(header, body)


if __name__ == "__main__":
    print(format_zeropp_table(zeropp_table()))
    sys.exit(0)
