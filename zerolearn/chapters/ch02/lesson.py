"""Chapter 2, ZeRO-1 (P_os): the version many write first, and the runner of the comparisons.

Chapter 2 writes its naive ZeRO-1 and the two whole-tensor splits in its own cells;
:class:`NaiveZero1` here is the same class, kept for chapter 3, which compares the
blog's ZeRO-2 with it. It is the one found in many tutorials (and in the blog this
book starts from): each rank *owns whole tensors*, every gradient is all-reduced,
each rank steps Adam on the tensors it owns, then every owner broadcasts its
updated tensors. It trains correctly, but

* whole-tensor ownership leaves shards unequal: the rank owning the largest
  tensors sets everyone's memory (flat padded shards, ``zerolearn.flat``, do not);
* all-reduce (2 Psi) plus broadcast (Psi) moves 3 Psi per step, where
  reduce-scatter plus all-gather moves 2 Psi, DP's volume (paper Sec 1, Sec 7).

Everything here runs on ranks spawned by :func:`zerolearn.dist.launch`; the real
engine is :class:`zerolearn.engines.Zero1Engine`. The layout of the chapter's tables and
plots (:func:`imbalance_figure`, :func:`bytes_tables`, :func:`bytes_figure`,
:func:`traffic_table`) is here too, so that the chapter's cells show the computation. The chapter's exercises
(``02.shard_range``, ``02.zero1_step``) are beside this module, in :mod:`zerolearn.chapters.ch02`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.memory import model as analytic
from zerolearn.memory.ledger import MemoryLedger, retag
from zerolearn.tables import kib, text_table
from zerolearn.train import batch, build, loss_fn, train
from zerolearn.watch import watching


# ----- who owns what --------------------------------------------------------------
def owners_by_count(n_tensors: int, world_size: int) -> list[int]:
    """The blog's split: equal *numbers* of tensors per rank, in order (Sec 5.1 done by tensor).

    Rank r owns a contiguous run of tensor indices; the first ``n % world_size``
    ranks get one extra. Returns the owning rank of each tensor.
    """
    per_rank, extra = divmod(n_tensors, world_size)
    owners = []
    for r in range(world_size):
        owners += [r] * (per_rank + (1 if r < extra else 0))
    return owners


def owners_by_size(sizes: list[int], world_size: int) -> list[int]:
    """The best simple whole-tensor split: largest tensor first, to the emptiest rank.

    Still whole tensors, so no rank can hold less than the largest one.
    Returns the owning rank of each tensor (ties go to the lower rank).
    """
    load, owners = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i], load[r] = r, load[r] + sizes[i]
    return owners


OWNERS = {"count": lambda sizes, nd: owners_by_count(len(sizes), nd), "size": owners_by_size}


# ----- the naive ZeRO-1 ---------------------------------------------------------
class NaiveZero1:
    """ZeRO-1 as often written: whole-tensor ownership, all_reduce then broadcast.

    Args:
        model: an fp32 ``nn.Module``, identical on every rank.
        lr: Adam's learning rate.
        owners: ``"count"`` (the blog's split) or ``"size"`` (greedy by size).

    Per step it all-reduces every gradient (2 Psi in the paper's count, Sec 7.1),
    steps Adam on the owned tensors only, then broadcasts each tensor from its owner
    (Psi more): 3 Psi, one collective per tensor. Optimizer state per rank is
    8 bytes (Adam's two fp32 moments) per *owned* element: unequal across ranks.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, owners: str = "count"):
        self.params = [p for p in model.parameters() if p.requires_grad]
        ctx = zdist.context()
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.owners = OWNERS[owners]([p.numel() for p in self.params], self.world_size)
        mine = [p for p, r in zip(self.params, self.owners, strict=True) if r == self.rank]
        self.optimizer = torch.optim.Adam(mine, lr=lr)  # state only for what this rank owns

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:  # every rank gets every averaged gradient: 2 Psi
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        self.optimizer.step()  # updates only the owned tensors
        for p, owner in zip(self.params, self.owners, strict=True):  # owners send the new values: Psi
            dist.broadcast(p.data, src=owner)


def _tag_grads_as_they_arrive(params: list[nn.Parameter]) -> None:
    # Ledger bookkeeping only: autograd creates p.grad during backward (booked as
    # "temporary"); move it to "grads" once it is complete.
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: retag([p.grad], "grads"))


def _naive_step(config: TrainConfig, model: nn.Module, opt, state_tensors, losses: list, step: int):
    """One step of :func:`train_naive`, the last under a MemoryLedger: (gradient bytes held after
    backward, the ledger or None); the step's global loss is appended to ``losses``."""
    ctx = zdist.context()
    ledger = MemoryLedger(record_timeline=config.memory_timeline) if step == config.steps - 1 else None
    with ledger or contextlib.nullcontext():
        if ledger is not None:
            ledger.track(opt.params, "params")
            ledger.track(state_tensors(), "optimizer_states")
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(config, step))
        with ledger.phase("forward") if ledger else contextlib.nullcontext():
            loss = loss_fn(config, model(x), y)
        with ledger.phase("backward") if ledger else contextlib.nullcontext():
            loss.backward()
        grads_bytes = sum(p.grad.numel() * p.grad.element_size() for p in opt.params if p.grad is not None)
        with ledger.phase("step") if ledger else contextlib.nullcontext():
            opt.step()
            for p in opt.params:
                p.grad = None
    losses.append(comm.monitor_mean(loss.item()))
    return grads_bytes, ledger


def train_naive(cls: type, config: TrainConfig, **options) -> dict:
    """Train with a naive optimizer class on this rank; the same job as ``train(config)``.

    ``config`` sets the model, steps, batch, lr and seed (fp32 only);
    ``cls(model, lr=..., **options)`` must have ``params`` (the trainable parameters),
    ``optimizer`` (the torch optimizer over what this rank updates) and ``step()``. The
    same model, batches and loss as the engines, so the losses can be compared. The last
    step runs under a :class:`MemoryLedger` (``config.memory_timeline`` keeps its timeline).

    Returns this rank's ``{"losses", "optimizer_state_bytes", "grads_bytes" (held after
    backward), "comm", "peak_bytes", "memory", "num_params"}`` (bytes; ``comm`` as in
    the report).
    """
    ctx = zdist.context()
    config.validate(ctx.world_size)
    if config.dtype != "fp32":
        raise ValueError("the naive versions train in fp32 only")
    model = build(config)
    opt = cls(model, lr=config.lr, **options)

    def state_tensors() -> list[torch.Tensor]:  # Adam's per-element state on this rank
        return [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]

    _tag_grads_as_they_arrive(opt.params)
    comm.LEDGER.reset()
    losses, ledger = [], None
    with watching():  # the naive optimizers call torch's collectives by name: booked in comm.LEDGER
        for step in range(config.steps):
            grads_bytes, ledger = _naive_step(config, model, opt, state_tensors, losses, step)
    memory = ledger.summary()
    if config.memory_timeline:
        memory["timeline"] = [[e.index, e.phase, e.total, e.by_category] for e in ledger.timeline]
    return {"losses": losses, "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state_tensors()),
            "grads_bytes": grads_bytes, "comm": comm.LEDGER.as_dict(), "peak_bytes": memory["peak_bytes"],
            "memory": memory, "num_params": sum(p.numel() for p in opt.params)}


def jobs(specs: list[tuple]) -> list:
    """Run several jobs in one process group (spawning ranks costs seconds).

    Each spec is ``("train", config)`` (the package's engines: the report of
    :func:`zerolearn.train.train`), ``("naive", cls, config, options)``
    (:func:`train_naive`).
    """
    out = []
    for kind, *rest in specs:
        if kind == "train":
            out.append(train(rest[0]))
        elif kind == "naive":
            out.append(train_naive(rest[0], rest[1], **(rest[2] if len(rest) > 2 else {})))
        else:
            raise ValueError(f"unknown job kind {kind!r}")
    return out


# ----- the chapter's tables and plots -----------------------------------------------
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def imbalance_figure(nds: list[int], curves: dict[str, list[float]], results: dict, psi: int,
                     largest_tensor: int):
    """Section 5.1's plot: the fullest rank's optimizer state over ``K Psi / Nd``, against Nd.

    ``curves`` maps a label to one ratio per entry of ``nds`` (computed from the layouts);
    ``results[nd][rank][job]`` are the chapter's runs (jobs 0 the engine in fp32, 2 and 3
    the naive version split by count and by size), drawn as crosses. Returns the figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, ys), marker in zip(curves.items(), ("o", "s", "^"), strict=True):
        ax.plot(nds, ys, marker=marker, markersize=3, label=label)
    for nd in (3, 4):  # measured: the largest rank's Adam bytes (fp32, 8 per element) over 8 Psi / Nd
        worst = [max(per_rank[j]["optimizer_state_bytes"] for per_rank in results[nd]) for j in (2, 3)]
        worst.append(max(r["model_state_bytes"]["optimizer_states"] for r in results[nd][0][0]["ranks"]))
        ax.plot([nd] * 3, [w / (8 * psi / nd) for w in worst], "x", color="k", markersize=9)
    ax.plot([], [], "x", color="k", label="measured on gloo ranks")
    ax.plot(nds, [max(1, largest_tensor / (psi / n)) for n in nds], "k--", lw=0.8,
            label="floor for whole tensors: largest tensor / (Psi/Nd)")
    ax.set_xlabel("data-parallel degree $N_d$ (ranks)")
    ax.set_ylabel(r"largest rank's optimizer state / $(K\Psi/N_d)$")
    ax.set_title("Optimizer state on the fullest rank, relative to a perfect split")
    ax.set_ylim(0.9, None)
    ax.legend(fontsize=8)
    plt.close(fig)
    return fig


def bytes_tables(reports: list[dict]) -> tuple[str, str]:
    """Section 5.2's two tables for the engine's reports (rank 0; every rank holds the same).

    The first: KiB of params, grads and optimizer states held, their total and the paper's
    formula (unpadded Psi). The second: padding elements, measured minus formula, and
    padding x (param bytes + grad bytes + K/Nd), which must be equal.
    """
    held_rows, pad_rows = [], []
    for rep in reports:
        nd, dtype = rep["world_size"], rep["config"]["dtype"]
        k, width = analytic.optimizer_k("adam", dtype), analytic.dtype_bytes(dtype)
        held = rep["ranks"][0]["model_state_bytes"]
        total, formula = sum(held.values()), sum(rep["analytic"]["model_state_bytes"].values())
        pad = rep["ranks"][0]["padding_elements"]
        held_rows.append([nd, dtype, k, *(kib(held[c]) for c in ("params", "grads", "optimizer_states")),
                          kib(total)])
        pad_rows.append([nd, dtype, kib(formula), pad, f"{total - formula:,.0f}",
                         f"{pad * (2 * width + k / nd):,.0f}"])
    held = text_table(["Nd", "dtype", "K", "params KiB", "grads KiB", "optim KiB", "total KiB"], held_rows)
    pads = text_table(["Nd", "dtype", "formula KiB", "padding", "measured - formula B",
                       "padding x (p+g+K/Nd) B"], pad_rows)
    return held, pads


def bytes_figure(rows: list[tuple[int, str, int]], psi: int):
    """Section 5.2's plot: model-state bytes per parameter per rank against Nd, formula and
    measured (``rows``: (nd, dtype, bytes held) per run), for bf16 and fp32. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    grid = list(range(1, 17))
    for dtype, color in (("bf16", "C0"), ("fp32", "C1")):
        k, w = analytic.optimizer_k("adam", dtype), analytic.dtype_bytes(dtype)
        per_param = [analytic.model_state_bytes(1, n, 1, k=k, param_bytes=w, grad_bytes=w)["total"] for n in grid]
        ax.plot(grid, per_param, color=color, label=f"formula, {dtype}: $({w}+{w})\\Psi + {k}\\Psi/N_d$")
        ax.axhline(2 * w, color=color, ls=":", lw=1)
        ax.plot([nd for nd, d, _ in rows if d == dtype], [t / psi for nd, d, t in rows if d == dtype],
                "o", color=color, label=f"measured, {dtype}")
        ax.plot(1, 2 * w + k, "s", color=color, mfc="none", label=f"DP, {dtype} (formula)")
    ax.set_xlabel("data-parallel degree $N_d$ (ranks)")
    ax.set_ylabel("model-state bytes per parameter, per rank")
    ax.set_title("ZeRO-1: model-state bytes per rank (Sec 5.1, Fig 1)")
    ax.set_ylim(0, 17)
    ax.legend(fontsize=8)
    plt.close(fig)
    return fig


def traffic_table(runs: list[tuple[str, dict]], psi: int, steps: int) -> str:
    """Section 5.3's table: elements per step of each collective (the ledger's count),
    calls per step, and the paper's volume 2 all-reduce + reduce-scatter + all-gather +
    broadcast, in units of ``psi``. ``runs``: (name, the ledger's ``comm`` dict)."""
    rows = []
    for name, ops in runs:
        per_step = {op: ops[op]["elements"] // steps for op in OPS}
        volume = 2 * per_step["all_reduce"] + sum(per_step[op] for op in OPS[1:])
        rows.append([name, sum(ops[op]["calls"] for op in OPS) // steps, *(per_step[op] for op in OPS),
                     f"{volume / psi:.3f}"])
    return text_table(["version", "calls", *OPS, "Psi/step"], rows, align=["left", *["right"] * 6])
