"""Chapter 3, ZeRO-2 (P_os+g): a reproduction of a flawed ZeRO-2, and accumulation measured.

The blog this book starts from (seed 002) measured ZeRO-2's peak memory *above*
ZeRO-1's, which the paper's Sec 5.2 says cannot happen. :class:`BlogZero2` rebuilds
its ZeRO-2 at small scale, faithfully, to show why:

* its gradient hooks return ``None`` for the tensors a rank does not own, meaning
  to discard them; but a tensor hook that returns ``None`` leaves the gradient
  unchanged, so every rank still holds the whole gradient after backward;
* after backward, for every tensor, it concatenates the full gradient Nd times
  to make a reduce-scatter input and receives a full-size output: Nd + 1 extra
  copies of a tensor at once, and Nd x Psi elements on the wire (its "reduce-scatter"
  is an all-reduce in disguise);
* only then does it drop the gradients it does not own.

So its step holds everything ZeRO-1 holds plus those temporaries. The package's
:class:`zerolearn.engines.Zero2Engine` reduce-scatters flat buckets *during*
backward and frees each bucket as soon as its reduction is done.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm
from zerolearn.chapters.ch02.lesson import NaiveZero1


class BlogZero2(NaiveZero1):
    """The blog's ZeRO-2: whole-tensor ownership, per-tensor "reduce-scatter" of Nd copies.

    Args as :class:`zerolearn.chapters.ch02.lesson.NaiveZero1` (fp32 model, Adam ``lr``,
    ``owners``). Per step: reduce_scatter input Nd x Psi elements (the ledger's count),
    then a broadcast of every tensor from its owner (Psi): (Nd + 1) Psi in all.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, owners: str = "count"):
        super().__init__(model, lr, owners)
        for p, owner in zip(self.params, self.owners):
            # Meant to discard non-owned gradients. A hook's return value replaces the
            # gradient only when it is a tensor: returning None keeps the gradient.
            keep = owner == self.rank
            p.register_hook(lambda grad, keep=keep: grad if keep else None)

    @torch.no_grad()
    def step(self) -> None:
        for p, owner in zip(self.params, self.owners):
            flat = p.grad.contiguous().view(-1)
            stacked = torch.cat([flat for _ in range(self.world_size)])  # Nd copies of the full gradient
            out = torch.empty_like(flat)  # and a full-size output
            comm.reduce_scatter(out, stacked)  # every rank receives the whole sum
            if owner == self.rank:
                p.grad.data = (out / self.world_size).view_as(p)
            else:
                p.grad = None  # non-owned gradients are dropped only now, one by one
        self.optimizer.step()
        for p, owner in zip(self.params, self.owners):
            comm.broadcast(p.data, src=owner)


def hook_returning_none_keeps_gradient() -> bool:
    """Run the blog's "discard" hook on a tiny tensor: is the gradient still there?"""
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda grad: None)
    (2 * x).sum().backward()
    return x.grad is not None


def accumulation_tradeoff(micro_batches: int = 4, steps: int = 2) -> dict[str, dict]:
    """ZeRO-2 with gradient accumulation written two ways, on this process group.

    ``"backward each micro-batch"``: plain ``engine.backward`` per micro-batch, so each
    one is reduce-scattered at once and added into the rank's shard; ``"no_sync"``:
    the first micro-batches inside ``engine.no_sync()``, so gradients add up locally
    and only the last backward reduces. The package's GPT (d 64, 2 blocks, sequence
    32), a global batch of 16 sequences, fp32 Adam, buckets of 0.05 MiB.

    Returns per way: ``losses`` (global mean per step), ``reduce_scatter_calls`` and
    ``reduce_scatter_elements`` per step, ``peak_grad_bytes`` (most gradient bytes
    held at once, measured), ``psi``.
    """
    from zerolearn import data
    from zerolearn import dist as zdist
    from zerolearn.engines import make_engine
    from zerolearn.models import GPTConfig, build_model

    ctx, gpt = zdist.context(), GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
    out = {}
    for way in ("backward each micro-batch", "no_sync"):
        engine = make_engine(2, build_model("gpt", 0, gpt=gpt), optimizer="adam", lr=1e-3, bucket_mb=0.05)
        comm.LEDGER.reset()
        losses = []
        for step in range(steps):
            x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in data.gpt_batch(step, 16, gpt.seq_len))
            local = 0.0
            for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
                loss = F.cross_entropy(engine(xm).float().flatten(0, 1), ym.flatten()) / micro_batches
                if way == "no_sync" and i < micro_batches - 1:
                    with engine.no_sync():
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                local += loss.item()
            engine.step()
            engine.zero_grad()
            losses.append(comm.monitor_mean(local))
        rs = comm.LEDGER.as_dict()["reduce_scatter"]
        out[way] = {"losses": losses, "reduce_scatter_calls": rs["calls"] // steps,
                    "reduce_scatter_elements": rs["elements"] // steps,
                    "peak_grad_bytes": engine.peak_grad_bytes, "psi": engine.psi}
    return out

