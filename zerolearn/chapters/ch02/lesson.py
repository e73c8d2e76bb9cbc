"""Chapter 2, ZeRO-1 (P_os): the version many write first, beside the real one.

The naive ZeRO-1 below is the one found in many tutorials (and in the blog this
book starts from): each rank *owns whole tensors*, every gradient is all-reduced,
each rank steps Adam on the tensors it owns, then every owner broadcasts its
updated tensors. It trains correctly, but

* whole-tensor ownership leaves shards unequal: the rank owning the largest
  tensors sets everyone's memory (flat padded shards, ``zerolearn.flat``, do not);
* all-reduce (2 Psi) plus broadcast (Psi) moves 3 Psi per step, where
  reduce-scatter plus all-gather moves 2 Psi (paper Sec 7.2.1).

Everything here runs on ranks spawned by :func:`zerolearn.dist.launch`; the real
engine is :class:`zerolearn.engines.Zero1Engine`. The chapter's exercises
(``02.shard_range``, ``02.zero1_step``) are beside this module, in :mod:`zerolearn.chapters.ch02`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.flat import make_buckets
from zerolearn.memory.ledger import MemoryLedger, retag
from zerolearn.models import GPTConfig, build_model
from zerolearn.train import batch, build, loss_fn, train


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


def owned_elements(sizes: list[int], owners: list[int], world_size: int) -> list[int]:
    """Elements each rank owns (and keeps optimizer state for) under ``owners``."""
    per_rank = [0] * world_size
    for size, r in zip(sizes, owners):
        per_rank[r] += size
    return per_rank


def flat_shard_elements(sizes: list[int], world_size: int, bucket_bytes: int, element_size: int = 4) -> list[int]:
    """Elements per rank under flat padded shards (``zerolearn.flat``), as the engines lay them out.

    Every group is padded to a multiple of ``world_size`` and split equally, so all
    ranks get the same count: (Psi + padding) / Nd.
    """
    params = [nn.Parameter(torch.empty(s)) for s in sizes][::-1]  # engines: reverse order
    names = [str(i) for i in range(len(params))]
    per_rank = [0] * world_size
    for r in range(world_size):
        groups = make_buckets(list(zip(names, params)), bucket_bytes, element_size, world_size, r)
        per_rank[r] = sum(g.shard_numel for g in groups)
    return per_rank


def gpt_tensor_sizes(d_model: int = 64, seq_len: int = 32, n_layer: int = 2, n_head: int = 4) -> list[int]:
    """Element counts of the GPT's trainable tensors, in ``model.parameters()`` order."""
    cfg = GPTConfig(seq_len=seq_len, n_layer=n_layer, n_head=n_head, d_model=d_model)
    return [p.numel() for p in build_model("gpt", 0, gpt=cfg).parameters()]


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
        mine = [p for p, r in zip(self.params, self.owners) if r == self.rank]
        self.optimizer = torch.optim.Adam(mine, lr=lr)  # state only for what this rank owns

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:  # every rank gets every averaged gradient: 2 Psi
            comm.all_reduce(p.grad)
            p.grad /= self.world_size
        self.optimizer.step()  # updates only the owned tensors
        for p, owner in zip(self.params, self.owners):  # owners send the new values: Psi
            comm.broadcast(p.data, src=owner)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Adam's per-element state on this rank (its two moments per owned tensor)."""
        return [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]

    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())


def _tag_grads_as_they_arrive(params: list[nn.Parameter]) -> None:
    # Ledger bookkeeping only: autograd creates p.grad during backward (booked as
    # "temporary"); move it to "grads" once it is complete.
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: retag([p.grad], "grads"))


def train_naive(cls: type, config: TrainConfig, **options) -> dict:
    """Train with a naive optimizer class on this rank; the same job as ``train(config)``.

    ``config`` sets the model, steps, batch, lr and seed (fp32 only);
    ``cls(model, lr=..., **options)`` must have ``step``, ``zero_grad``
    and ``state_tensors``. The same model, batches and loss as the engines, so the
    losses can be compared. The last step runs under a :class:`MemoryLedger`
    (``config.memory_timeline`` keeps its timeline).

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
    _tag_grads_as_they_arrive(opt.params)
    comm.LEDGER.reset()
    losses, ledger = [], None
    for step in range(config.steps):
        ledger = MemoryLedger(record_timeline=config.memory_timeline) if step == config.steps - 1 else None
        with ledger or contextlib.nullcontext():
            if ledger is not None:
                ledger.track(opt.params, "params")
                ledger.track(opt.state_tensors(), "optimizer_states")
            x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in batch(config, step))
            with ledger.phase("forward") if ledger else contextlib.nullcontext():
                loss = loss_fn(config, model(x), y)
            with ledger.phase("backward") if ledger else contextlib.nullcontext():
                loss.backward()
            grads_bytes = sum(p.grad.numel() * p.grad.element_size() for p in opt.params if p.grad is not None)
            with ledger.phase("step") if ledger else contextlib.nullcontext():
                opt.step()
                opt.zero_grad()
        losses.append(comm.monitor_mean(loss.item()))
        del loss
    memory = ledger.summary()
    if config.memory_timeline:
        memory["timeline"] = [[e.index, e.phase, e.total, e.by_category] for e in ledger.timeline]
    return {"losses": losses, "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in opt.state_tensors()),
            "grads_bytes": grads_bytes, "comm": comm.LEDGER.as_dict(), "peak_bytes": memory["peak_bytes"],
            "memory": memory, "num_params": sum(p.numel() for p in opt.params)}


# ----- the two collectives of ZeRO-1, on tiny tensors ---------------------------------
def collectives_demo(n: int = 6) -> dict:
    """Reduce-scatter then all-gather on this rank, with small numbers to read.

    Rank r's "gradient" is ``(r + 1) * [0, 1, ..., n-1]``; reduce-scatter gives rank r
    the r-th slice of the sum; each rank "updates" its slice (subtracts 0.5) and
    all-gather rebuilds the full vector everywhere. ``n`` must divide by the world size.
    """
    ctx = zdist.context()
    grad = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1)
    shard = torch.empty(n // ctx.world_size)
    comm.reduce_scatter(shard, grad)
    updated = shard - 0.5
    full = torch.empty(n)
    comm.all_gather(full, updated)
    return {"grad": grad.tolist(), "shard": shard.tolist(), "full": full.tolist()}


def jobs(specs: list[tuple]) -> list:
    """Run several jobs in one process group (spawning ranks costs seconds).

    Each spec is ``("train", config)`` (the package's engines: the report of
    :func:`zerolearn.train.train`), ``("naive", cls, config, options)``
    (:func:`train_naive`) or ``("demo",)`` (:func:`collectives_demo`).
    """
    out = []
    for kind, *rest in specs:
        if kind == "train":
            out.append(train(rest[0]))
        elif kind == "naive":
            out.append(train_naive(rest[0], rest[1], **(rest[2] if len(rest) > 2 else {})))
        elif kind == "demo":
            out.append(collectives_demo(*rest))
        else:
            raise ValueError(f"unknown job kind {kind!r}")
    return out
