"""ZeRO-Offload and ZeRO-Infinity's offload measured: bytes by location, step time, loss, disk I/O.

:func:`offload_table` trains the book's GPT at one stage on spawned gloo ranks, once per
option: no offload, ``offload="cpu"`` (ZeRO-Offload, Ren et al., ATC'21, arXiv
2101.06840), ``offload="disk"`` (ZeRO-Infinity's NVMe tier, SC'21, arXiv 2104.07857) and
``offload="cpu"`` with the one-step delayed parameter update. Every run starts from the
same weights and trains on the same global batches; a row says what rank 0 holds on the
device, in host memory and on disk, beside
:func:`zerolearn.memory.model.offload_state_bytes`, and how its losses differ from the
plain stage's. On a CPU-only machine "device" and "host" are the same memory: the split
is the engine's bookkeeping of which tensors it keeps where (pinned host memory on CUDA).

    .venv/bin/python -m zerolearn.experiments.offload      # prints the table (2 ranks, stage 2)
"""

from __future__ import annotations

import sys

from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.errors import ConfigError
from zerolearn.experiments._gpt import LR, check_run, small_gpt, train_steps
from zerolearn.memory.model import offload_state_bytes, optimizer_k
from zerolearn.tables import kib, text_table

OPTIONS: dict[str, dict] = {
    "none": {},
    "cpu": {"offload": "cpu"},
    "disk": {"offload": "disk"},
    "cpu+dpu": {"offload": "cpu", "dpu": True},
}
LOCATIONS = ("device", "host", "disk")


def train_option(stage: int, options: dict, steps: int, d_model: int, n_layer: int = 2,
                 optimizer: str = "adam", lr: float = LR, dtype: str = "fp32") -> dict:
    """On every rank of the current process group: train ``steps`` steps at ``stage`` with
    the offload ``options`` (keywords of :class:`zerolearn.engines.Engine`).

    Returns (this rank's): ``losses`` (global mean per step), ``bytes`` (by location and
    category: gradients as held after the last backward, parameters and optimizer states
    after the last step; disk: file sizes), ``formula`` (the same from
    :func:`offload_state_bytes` with Psi + padding), ``io`` (the last step's
    :meth:`Engine.offload_stats`), ``step_s`` (median step after the first, seconds),
    ``psi``, ``padding``.
    """
    ctx = zdist.context()
    engine = make_engine(stage, small_gpt(d_model, n_layer), optimizer=optimizer, lr=lr, dtype=dtype, **options)
    after_backward = {}
    try:
        losses, step_s = train_steps(engine, steps, lambda step: after_backward.update(
            engine.model_state_bytes_by_location()))
        io = engine.offload_stats()
        held = engine.model_state_bytes_by_location()
        for loc in LOCATIONS:
            held[loc]["grads"] = after_backward[loc]["grads"]
        offload = options.get("offload")
        k = optimizer_k(optimizer, "bf16" if offload else dtype)  # offload: the master is always its own
        formula = offload_state_bytes(engine.psi + engine.padding, ctx.world_size, stage, offload, dtype, k)
        return {"losses": losses, "bytes": held, "formula": formula, "io": io,
                "step_s": step_s, "psi": engine.psi, "padding": engine.padding}
    finally:
        engine.close()


def offload_rows(stage: int, steps: int = 4, d_model: int = 64) -> list[dict]:
    """:func:`offload_table`'s rows, run on every rank of the current process group (for
    ranks already running, such as :mod:`zerolearn.live`'s); each rank returns its own."""
    runs = {name: train_option(stage, opts, steps, d_model) for name, opts in OPTIONS.items()}
    plain = runs["none"]
    rows = []
    for name, run in runs.items():
        row = {"option": name, "stage": stage}
        for loc in LOCATIONS:
            row[f"{loc} B"] = sum(run["bytes"][loc].values())
            row[f"{loc} formula B"] = sum(run["formula"][loc].values())
        row["bytes"], row["formula"] = run["bytes"], run["formula"]
        row["step ms"] = run["step_s"] * 1e3
        row["max |loss diff|"] = max(abs(a - b) for a, b in zip(run["losses"], plain["losses"], strict=True))
        row["losses"] = run["losses"]
        row.update({k: run["io"][k] for k in ("bytes_read", "bytes_written", "read_bandwidth", "write_bandwidth")})
        row["psi"], row["padding"] = run["psi"], run["padding"]
        rows.append(row)
    return rows


def offload_table(world_size: int = 2, stage: int = 2, steps: int = 4, d_model: int = 64) -> list[dict]:
    """One row per option (none, cpu, disk, cpu+dpu) at ``stage``, measured on
    ``world_size`` spawned gloo ranks, as rank 0 sees it (fp32, Adam).

    Row keys: ``option``, ``stage``; ``"<loc> B"`` and ``"<loc> formula B"`` for ``loc``
    in device, host, disk: model-state bytes rank 0 holds there, measured and from
    :func:`zerolearn.memory.model.offload_state_bytes` (Psi + padding); ``bytes`` and
    ``formula``: the same by category; ``step ms`` (median step after the first,
    milliseconds, this machine); ``max |loss diff|`` (largest difference of the global
    mean loss from the plain stage's over the steps; 0 without DPU, where offload is bit
    for bit the plain run); ``losses``; ``bytes_read``, ``bytes_written`` (the last
    step's disk I/O, bytes), ``read_bandwidth``, ``write_bandwidth`` (bytes/s; 0 without
    disk); ``psi``, ``padding``.

    Raises:
        ConfigError: ``world_size``, ``steps`` or ``d_model`` not an integer >= 1,
            ``d_model`` odd (2 attention heads), ``world_size`` not dividing the batch of
            8, ``stage`` not 1, 2 or 3.
    """
    check_run(world_size, steps, d_model)
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"stage={stage!r}: allowed are 1, 2, 3 (offload needs a partitioned optimizer)")
    return zdist.launch(offload_rows, world_size, stage, steps, d_model)[0]


def format_offload_table(rows: list[dict]) -> str:
    """The table as text: KiB per location measured / formula, step time, loss difference, disk I/O."""
    header = ["stage", "option", "device KiB\nmeasured / formula", "host KiB\nmeasured / formula",
              "disk KiB\nmeasured / formula", "step ms", "max |loss|\ndiff", "read / written\nKiB per step",
              "read / write\nMiB/s"]
    body = [[r["stage"], r["option"], *(f"{kib(r[f'{loc} B'])} / {kib(r[f'{loc} formula B'])}" for loc in LOCATIONS),
             f"{r['step ms']:.1f}", f"{r['max |loss diff|']:.1e}",
             f"{kib(r['bytes_read'])} / {kib(r['bytes_written'])}",
             f"{r['read_bandwidth'] / 2**20:.0f} / {r['write_bandwidth'] / 2**20:.0f}"] for r in rows]
    return text_table(header, body)


if __name__ == "__main__":
    print(format_offload_table(offload_table(stage=2) + offload_table(stage=3)))
    sys.exit(0)
