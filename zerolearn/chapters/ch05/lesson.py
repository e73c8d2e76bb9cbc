"""Chapter 5, ZeRO-R: the runs the chapter measures.

``zero_r_run`` trains the book's GPT (``zerolearn.exercises.helpers.GPT``, Psi =
42,368) on an Nd x Nm world with Megatron-style tensor parallelism, optionally with
activation checkpointing and ZeRO-R's P_a, P_a+cpu or contiguous checkpoint pool
(``zerolearn.residual``), and returns what it measured. ``md_comparison`` records real
training steps of GPTs of several sizes and replays them through the allocator model of
``zerolearn.residual.defrag`` with and without MD (Sec 6.3). ``lifetime_table`` and
``md_tables`` lay out what section 4 prints, through :func:`zerolearn.tables.text_table`.
"""

from __future__ import annotations

from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.exercises.helpers import GPT  # the book's GPT: 2 heads, so Nm = 2 gives each rank one
from zerolearn.figures import recorded_trace
from zerolearn.models import GPTConfig, build_model
from zerolearn.residual import buffers, defrag
from zerolearn.tables import text_table
from zerolearn.train import train

BATCH = 8  # global; divisible by Nd = 1, 2, 4
# The chapter's ZeRO-R variants on Nd x Nm = 2 x 2: keyword arguments of zero_r_run.
VARIANTS = {
    "Nm = 2": dict(nm=2),
    "+ checkpointing": dict(nm=2, checkpointing=True),
    "+ P_a": dict(nm=2, checkpointing=True, partition=True),
    "+ P_a+cpu": dict(nm=2, checkpointing=True, partition=True, cpu=True),
    "+ P_a, contiguous (MD)": dict(nm=2, checkpointing=True, partition=True, contiguous=True),
}


def zero_r_run(stage: int = 0, nm: int = 1, checkpointing: bool = False, partition: bool = False,
               cpu: bool = False, contiguous: bool = False, steps: int = 3, bucket_mb: float = 0.05,
               batch: int = BATCH) -> dict:
    """Train the chapter's GPT on the current world (Nd = world / nm) with :func:`zerolearn.train.train`,
    ``batch`` sequences per step in all (divisible by Nd).

    Returns this rank's measurements as a dict: ``losses`` (global mean per step),
    ``checkpoint_bytes`` ((device, host) bytes held at the end of forward),
    ``activation_bytes`` (the ledger's activations at the end of forward), ``by_tag``
    (traffic by purpose: dp, tp, pa), ``temp_buffer_peak_bytes`` (largest fused
    buffer), ``transfer_seconds``, ``psi``.
    """
    config = TrainConfig(stage=stage, model="gpt", seq_len=GPT.seq_len, n_layer=GPT.n_layer, n_head=GPT.n_head,
                         d_model=GPT.d_model, global_batch_size=batch, steps=steps, bucket_mb=bucket_mb,
                         tensor_parallel=nm, checkpoint_activations=checkpointing, partition_activations=partition,
                         cpu_checkpointing=cpu, contiguous_checkpoints=contiguous)
    report = train(config)
    entry = report["ranks"][zdist.context().rank]
    residual = entry["residual"]
    return {"losses": report["losses"],
            "checkpoint_bytes": (residual["checkpoint_bytes_device"], residual["checkpoint_bytes_host"]),
            "activation_bytes": residual["activation_bytes_end_of_forward"], "by_tag": entry["comm_by_tag"],
            "temp_buffer_peak_bytes": residual["temp_buffer_peak_bytes"],
            "transfer_seconds": residual["transfer_seconds"], "psi": report["num_params"]}


def zero_r_runs(runs: list[dict]) -> list[dict]:
    """Several :func:`zero_r_run` in one process group (one spawn)."""
    return [zero_r_run(**kw) for kw in runs]


def bucket_sweep(widths: list[int], bucket_mbs: list[float], stage: int = 2) -> list[dict]:
    """Largest fused buffer (bytes) of one MLP step per (width, bucket size): CB, Sec 6.2."""
    return [buffers.fused_buffer_peak(stage, width, 6, bucket_mb) for width in widths for bucket_mb in bucket_mbs]


def md_comparison(sizes=((4, 256), (4, 512), (8, 512))) -> list[dict]:
    """MD on real traces: for each ``(n_layer, d_model)`` GPT (seq 512, batch 8,
    ``defrag.record_gpt_steps``), the smallest memory without and with MD, and what
    happens without MD in the memory that is just enough with it.

    Returns one dict per size: ``n_layer``, ``d_model``, ``psi`` (parameters),
    ``without_md`` and ``with_md`` (smallest arena, bytes), ``ok`` (the step fits
    without MD in ``with_md`` bytes), ``free_fraction`` (share of memory free when it
    failed), ``request`` (bytes asked for then), ``phase`` (where it failed),
    ``live_peak`` (most bytes live at once), ``pools`` (MD's pools, one per lifetime
    class, each as large as its class's own peak) and ``long_peak`` (most bytes the
    long-lived tensors hold at once: one shared pool would do with this).
    """
    rows = []
    for n_layer, d_model in sizes:
        cfg = GPTConfig(**{**defrag.FRAGMENTING_GPT, "n_layer": n_layer, "d_model": d_model})
        default = cfg == GPTConfig(**defrag.FRAGMENTING_GPT)
        trace = recorded_trace() if default else defrag.record_gpt_steps(cfg)
        with_md = defrag.smallest_capacity(trace, md=True)
        r, classes = defrag.replay(trace, with_md, md=False), defrag.lifetime_classes(trace)
        rows.append({"n_layer": n_layer, "d_model": d_model,
                     "psi": sum(p.numel() for p in build_model("gpt", 0, gpt=cfg).parameters()),
                     "without_md": defrag.smallest_capacity(trace, md=False), "with_md": with_md, "ok": r.ok,
                     "free_fraction": r.free_fraction, "request": r.failed_bytes,
                     "phase": None if r.ok else trace[r.failed_event][3],
                     "live_peak": defrag.pool_bytes(trace, {uid for _, uid, _, _ in trace}),
                     "pools": sum(defrag.pool_bytes(trace, {u for u, c in classes.items() if c == name})
                                  for name in set(classes.values())),
                     "long_peak": defrag.pool_bytes(trace, set(classes))})
    return rows


LIFETIMES = [("setup->end", "parameters"), ("step->end", "Adam's moments"),
             ("forward->backward", "kept for backward"), ("backward->step", "gradients")]


def lifetime_table(trace: list) -> str:
    """The long-lived tensors of a recorded ``trace`` (``defrag``'s format) by lifetime class:
    how many, and the most MiB (2**20 bytes) each class holds at once (Sec 6.3)."""
    classes, rows = defrag.lifetime_classes(trace), []
    for name, what in LIFETIMES:
        members = {u for u, c in classes.items() if c == name}
        rows.append([name, what, len(members), f"{defrag.pool_bytes(trace, members) / 2**20:.1f}"])
    return text_table(["lifetime", "what", "tensors", "MiB at most"], rows, align=["left", "left", "right", "right"])


def md_tables(rows: list[dict]) -> str:
    """:func:`md_comparison`'s rows as two tables, in MiB (2**20 bytes): the least memory
    each needs without and with MD (and how far above the live peak), with what happens
    without MD in MD's memory; then MD's pools against one shared pool."""
    def mib(nbytes: int) -> str:
        return f"{nbytes / 2**20:.0f}"

    need, pools = [], []
    for r in rows:
        gpt = f"{r['n_layer']} x {r['d_model']}"
        outcome = "fits" if r["ok"] else f"OOM: {mib(r['request'])} MiB asked, {r['free_fraction']:.0%} free"
        over = {k: f"{mib(r[k])} (+{mib(r[k] - r['live_peak'])})" for k in ("without_md", "with_md")}
        need.append([gpt, f"{r['psi'] / 1e6:.1f}M", mib(r["live_peak"]), over["without_md"], over["with_md"], outcome])
        pools.append([gpt, mib(r["pools"]), mib(r["long_peak"]), mib(r["pools"] - r["long_peak"])])
    return (text_table(["blocks x hidden", "Psi", "live peak", "without MD", "with MD", "without MD, in MD's memory"],
                       need, align=["right"] * 5 + ["left"]) + "\n\n" +
            text_table(["blocks x hidden", "MD pools", "one pool", "separation"], pools))
