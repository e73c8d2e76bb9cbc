"""Exercise ``02.zero1_step``: one ZeRO-1 (P_os) step on a flat gradient (paper Sec 5.1, Sec 7.2.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch02.zero1_step_check`.
"""

import torch
from torch import nn

from zerolearn import comm


def zero1_step(flat_params, flat_grad, state, world_size, rank, lr):
    """One ZeRO-1 (P_os) step on this rank: reduce-scatter, update the shard, all-gather.

    Args:
        flat_params: (n,) fp32, every parameter of the model end to end, then zeros up to
            n, a multiple of world_size. The model's parameters are views into it: on
            return it must hold the updated parameters, written in place.
        flat_grad: (n,) fp32, this rank's gradient (of the mean loss on its slice of the
            batch), laid out as ``flat_params``, zeros in the padding.
        state: a dict kept from step to step, empty at the first step. Keep in it an fp32
            master copy of this rank's shard of the parameters (elements
            ``[rank * n // world_size, (rank + 1) * n // world_size)``) and a
            ``torch.optim.Adam(..., lr=lr)`` over that master alone, so that Adam's moments
            cover 1/Nd of the model.
        world_size: the number of ranks, Nd.
        rank: this rank.
        lr: Adam's learning rate.

    Returns:
        (n // world_size,) fp32: the averaged gradient of this rank's shard, the one
        Adam stepped with.

    Move data with ``comm.reduce_scatter(output, input)`` and ``comm.all_gather(output,
    input)`` only: ZeRO-1 moves 2 Psi per step, as DP does (Sec 7.2.1).
    """
    # BEGIN SOLUTION
    shard = flat_params.numel() // world_size
    if not state:  # the first step: this rank's master shard, and Adam over it alone
        state["master"] = nn.Parameter(flat_params[rank * shard:(rank + 1) * shard].clone())
        state["adam"] = torch.optim.Adam([state["master"]], lr=lr)
    master, adam = state["master"], state["adam"]
    grad = torch.empty(shard)
    comm.reduce_scatter(grad, flat_grad)  # the sum over ranks of this rank's shard only
    grad.div_(world_size)
    master.grad = grad
    adam.step()
    master.grad = None
    comm.all_gather(flat_params, master.detach())  # every rank's updated shard, on every rank
    return grad
    # END SOLUTION
