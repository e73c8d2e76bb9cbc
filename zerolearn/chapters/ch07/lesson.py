"""Chapter 7, in practice: our stages beside torch's DDP, ZeroRedundancyOptimizer and FSDP2.

``side_by_side`` trains the same GPT on the same global batches with each
implementation on the current process group and returns, per implementation, the
losses, the model-state bytes this rank holds (counted from its tensors: local shards
of DTensors, the optimizer's local state) and the median step time. The DeepSpeed
config keys that correspond to our stages are in ``DEEPSPEED_CONFIG``.

The tables and the figure the chapter prints are laid out here (``*_table``,
:func:`states_figure`), every table through :func:`zerolearn.tables.text_table` and at
most 7 columns wide: the benchmark's table of 12 columns is shown as two, its times and
its bytes (:func:`bench_table`).

The chapter's exercises (``07.stage_from_bytes``, ``07.choose_stage``) are beside this
module, in :mod:`zerolearn.chapters.ch07`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from zerolearn import comm, compat, data
from zerolearn import dist as zdist
from zerolearn.engines import make_engine
from zerolearn.models import GPTConfig, build_model
from zerolearn.tables import kib, text_table
from zerolearn.train import step_engine

GPT = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
BATCH, LR = 8, 1e-3

# Our stage -> the DeepSpeed config that does the same thing (DeepSpeed's docs, "ZeRO").
DEEPSPEED_CONFIG = {
    0: {"zero_optimization": {"stage": 0}},
    1: {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}},
    2: {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True,
                              "contiguous_gradients": True}},
    3: {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                              "stage3_param_persistence_threshold": 0}},
}
# Our stage -> the PyTorch API that shards the same states.
TORCH_EQUIVALENT = {0: "DistributedDataParallel", 1: "ZeroRedundancyOptimizer (+ DDP)",
                    2: "no exact match; closest: fully_shard(reshard_after_forward=False), which keeps "
                       "parameters gathered from forward to backward but shards them at rest",
                    3: "fully_shard (FSDP2, FULL_SHARD)"}


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.untyped_storage().data_ptr() not in seen and t.numel() > 1:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(opt) -> list:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local one in .optim
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]


def _batch(step: int):
    ctx = zdist.context()
    x, y = data.gpt_batch(step, BATCH, GPT.seq_len)
    return data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)


def _loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _run_torch(kind: str, steps: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = build_model("gpt", 0, gpt=GPT)
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = compat.fully_shard()
        ctx = zdist.context()  # the mesh on the ranks' device (gloo ranks: the CPU, even where CUDA is present)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for unit in net.units():
            fully_shard(unit, mesh=mesh, reshard_after_forward=kind == "fsdp2")
        wrapped = fully_shard(net, mesh=mesh, reshard_after_forward=kind == "fsdp2")
        opt = torch.optim.Adam(net.parameters(), lr=LR)
    else:
        wrapped = DDP(net)
        opt = (torch.optim.Adam(net.parameters(), lr=LR) if kind == "ddp" else
               ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=LR))
    losses, times, grads = [], [], 0
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = _batch(step)
        loss = _loss(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        grads = _local_bytes(p.grad for p in net.parameters())
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(comm.monitor_mean(loss.item()))
    return {"losses": losses, "step_s": statistics.median(times),
            "bytes": {"params": _local_bytes(net.parameters()), "grads": grads,
                      "optimizer_states": _local_bytes(_optimizer_tensors(opt))}}


def hf_gpt2_zero3(steps: int = 3) -> dict:
    """A Hugging Face ``GPT2LMHeadModel`` (tiny config built in code: vocabulary 256,
    2 layers, d 64, tied embeddings, no dropout) under ZeRO-3 on this process group,
    each of its transformer blocks a unit, and the same model in one process on the
    whole batch.

    Returns ``losses`` and ``reference_losses`` (global mean per step), ``psi``
    (trainable parameters, the tied weight counted once), ``params_bytes`` (working
    parameter bytes this rank holds between steps) and ``units`` (how many).
    Raises ImportError when transformers is not installed (``pip install .[hf]``).
    """
    import transformers

    def build():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=GPT.seq_len, n_embd=64, n_layer=2, n_head=4,
                                      attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)

    ref_model = build()
    opt = torch.optim.Adam(ref_model.parameters(), lr=LR)
    reference = []
    for step in range(steps):
        x, y = data.gpt_batch(step, BATCH, GPT.seq_len)
        opt.zero_grad()
        loss = _loss(ref_model(x).logits, y)
        loss.backward()
        opt.step()
        reference.append(loss.item())
    model = build()
    # Units in forward order. The embeddings, the final norm and the tied head stay in
    # the root unit, gathered for the whole forward and backward: the head reads the
    # token embedding's weight long after the embedding's own forward has returned.
    engine = make_engine(3, model, optimizer="adam", lr=LR, units=list(model.transformer.h), bucket_mb=4.0)
    losses = []
    for step in range(steps):
        local, _ = step_engine(engine, [_batch(step)], lambda out, y: _loss(out.logits, y))
        losses.append(comm.monitor_mean(local))
    return {"losses": losses, "reference_losses": reference, "psi": engine.psi,
            "params_bytes": engine.model_state_bytes()["params"], "units": len(engine.units)}


def side_by_side(steps: int = 4) -> dict[str, dict]:
    """Every implementation on this process group: {name: {losses, bytes, step_s}}."""
    out = {}
    for stage in range(4):
        comm.LEDGER.reset()
        engine = make_engine(stage, build_model("gpt", 0, gpt=GPT), optimizer="adam", lr=LR, bucket_mb=0.25)
        losses, times, grads = [], [], 0
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = _batch(step)
            loss = _loss(engine(x), y)
            engine.backward(loss)
            grads = engine.model_state_bytes()["grads"]
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(comm.monitor_mean(loss.item()))
        held = engine.model_state_bytes()
        out[f"ours, stage {stage}"] = {
            "losses": losses, "step_s": statistics.median(times),
            "psi_per_step": comm.LEDGER.volume_elements() / steps / engine.psi,
            "bytes": {"params": held["params"], "grads": grads, "optimizer_states": held["optimizer_states"]}}
    for kind, name in (("ddp", "torch DDP"), ("zero", "torch ZeroRedundancyOptimizer"),
                       ("fsdp2_grad_op", "torch FSDP2, no reshard"), ("fsdp2", "torch FSDP2")):
        out[name] = _run_torch(kind, steps)
    return out


# ----- what the chapter prints ---------------------------------------------------------
CATEGORIES = ("params", "grads", "optimizer_states")


def side_by_side_table(results: dict[str, dict]) -> str:
    """:func:`side_by_side`'s result: per implementation the loss at the first and last
    step and the KiB of each model state one rank holds."""
    rows = [[name, f"{r['losses'][0]:.4f}", f"{r['losses'][-1]:.4f}", *(kib(r["bytes"][c]) for c in CATEGORIES)]
            for name, r in results.items()]
    last = len(next(iter(results.values()))["losses"]) - 1
    return text_table(["implementation", "loss@0", f"loss@{last}", "params KiB", "grads KiB", "optim KiB"], rows,
                      align=["left"] + ["right"] * 5)


def step_times_table(results: dict[str, dict]) -> str:
    """The median step time of each implementation in :func:`side_by_side`'s result, in ms."""
    return text_table(["implementation", "median step ms"],
                      [[name, f"{r['step_s'] * 1e3:.1f}"] for name, r in results.items()], align=["left", "right"])


def states_figure(results: dict[str, dict], ranks: int = 2) -> Figure:
    """Stacked bars: the KiB of parameters, gradients and optimizer states one rank holds,
    per implementation of :func:`side_by_side`'s result on ``ranks`` ranks."""
    names = list(results)
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(names)
    for category in CATEGORIES:
        values = [results[n]["bytes"][category] / 1024 for n in names]
        ax.bar(range(len(names)), values, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("model states per rank (KiB)")
    ax.set_title(f"The same job, {ranks} ranks: what each implementation keeps")
    ax.legend()
    return fig


def deepspeed_table(results: dict[str, dict], stored: dict[str, dict]) -> str:
    """Our stages (:func:`side_by_side`) beside DeepSpeed's (``stored``, the result of
    ``zerolearn.experiments.deepspeed_cpu``): last loss, the largest gap between the two
    loss curves, and the KiB of parameters, DeepSpeed's fp32 copy of its partition, and
    optimizer states one rank holds."""
    rows = []
    for stage in range(4):
        ours, ds = results[f"ours, stage {stage}"], stored[f"deepspeed, stage {stage}"]
        gap = max(abs(a - b) for a, b in zip(ours["losses"], ds["losses"], strict=True))
        for name, r, copy, shown in ((f"ours, stage {stage}", ours, 0, ""),
                                     (f"DeepSpeed, stage {stage}", ds, ds["bytes"]["master"],
                                      "< 1e-6" if gap < 1e-6 else f"{gap:.1e}")):
            rows.append([name, f"{r['losses'][-1]:.4f}", shown, kib(r["bytes"]["params"]), kib(copy),
                         kib(r["bytes"]["optimizer_states"])])
    return text_table(["KiB per rank", "last loss", "max |ours - DS|", "params", "fp32 copy", "optim"], rows,
                      align=["left"] + ["right"] * 5)


def bench_table(result: dict, part: str) -> str:
    """The benchmark's table (``zerolearn.bench.results``) in two parts of at most 7 columns:
    ``part="time"``: the job, then per system its stage, step-time median, spread and
    ratio to the best peer, and whether its losses equal ours; ``part="bytes"``: per system
    the bytes of each model state and the RSS of its busiest rank, then the notes (the
    paper's bytes, Sec 5). Raises ValueError for another ``part``."""
    from zerolearn.bench import results as bench

    head, _, foot = bench.format_table(result).split("\n\n", 2)
    cols, rows = bench.header(result), bench.table_rows(result)
    if part == "time":
        keep, text = list(range(7)), [head]
    elif part == "bytes":
        keep, text = [0, *range(7, len(cols))], []
    else:
        raise ValueError(f"part is 'time' or 'bytes', not {part!r}")
    table = text_table([cols[i] for i in keep], [[row[i] for i in keep if i < len(row)] for row in rows],
                       align=["left"] + ["right"] * (len(keep) - 1))
    return "\n\n".join([*text, table] + ([foot] if part == "bytes" else []))


def scaling_table(result: dict) -> str:
    """The scaling sweep (``zerolearn.bench.scaling``) per point and stage: rank 0's
    model-state bytes, measured and by Sec 5, and the traffic per step in Psi, measured by
    the ledger and by Sec 7. (The step times are in the sweep's figure.)"""
    rows = []
    for p in result["points"]:
        for name, s in p["systems"].items():
            if "error" in s:
                rows.append([p["world_size"], p["psi"], name, f"failed: {s['error']}"[:40]])
                continue
            comm_elements = s["comm_elements_per_step"]
            rows.append([p["world_size"], p["psi"], name, sum(s["bytes"][0].values()),
                         f"{sum(s['expected_bytes'].values()):,.0f}",
                         "-" if comm_elements is None else f"{comm_elements / p['psi']:.3f}",
                         f"{s['expected_comm_elements_per_step'] / p['psi']:g}"])
    return text_table(["Nd", "Psi", "system", "rank 0 bytes\nmeasured", "bytes\nSec 5", "traffic Psi\nmeasured",
                       "traffic Psi\nSec 7"], rows, align=["right"] * 2 + ["left"] + ["right"] * 4)
