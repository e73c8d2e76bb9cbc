"""Chapter 3, ZeRO-2 (P_os+g): a reproduction of a flawed ZeRO-2, and the checks.

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
from torch import nn

from zerolearn import comm
from zerolearn.lessons.ch02 import NaiveZero1, check


class BlogZero2(NaiveZero1):
    """The blog's ZeRO-2: whole-tensor ownership, per-tensor "reduce-scatter" of Nd copies.

    Args as :class:`zerolearn.lessons.ch02.NaiveZero1` (fp32 model, Adam ``lr``,
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


def grads_series(timeline: list) -> list[int]:
    """The ``grads`` category (bytes) at each event of a report's memory timeline."""
    return [event[3]["grads"] for event in timeline]


# ----- exercise checks -------------------------------------------------------------
def check_fig1_zero2(answer) -> None:
    """Exercise: ZeRO-2 model states per GPU for Fig 1's 7.5B model at Nd = 64, K = 12 (GB)."""
    psi, nd, k = 7.5e9, 64, 12
    check(answer, round((2 * psi + (2 + k) * psi / nd) / 1e9, 2), "GB", rel=4e-3)  # Fig 1 prints 16.6


def check_blog_volume(answer) -> None:
    """Exercise: Psi per step the blog's ZeRO-2 moves at Nd = 8 (reduce-scatter input plus broadcast)."""
    check(answer, 9, "Psi per step")


def check_hook(answer) -> None:
    """Exercise: does a hook that returns None discard the gradient? (True / False)"""
    if answer is None:
        print("Fill in `answer` first.")
        return
    discards = not hook_returning_none_keeps_gradient()
    print(f"Correct: {'it discards it' if discards else 'the gradient is kept'}." if answer == discards
          else "Not yet: run the hook on a tiny tensor and look at x.grad.")
