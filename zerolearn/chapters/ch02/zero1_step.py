"""Exercise ``02.zero1_step``: one ZeRO-1 (P_os) step on a flat gradient, in mixed precision
(paper Sec 3.1, Sec 5.1; DP's traffic, Sec 1 and Sec 7).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch02.zero1_step_check`; it is also
the optimizer step of every sharded stage of :mod:`zerolearn.nano`.
"""

import torch
import torch.distributed as dist
from torch import nn


def zero1_step(flat_params, flat_grad, state, world_size, rank, lr, *, reduced=False, gather=True):
    """One ZeRO-1 (P_os) step on this rank: reduce-scatter, update the fp32 master shard, all-gather.

    Args:
        flat_params: (n,) fp32 or bf16, the working parameters: every parameter of the
            model end to end, then zeros up to n, a multiple of world_size. The model's
            parameters are views into it: on return it must hold the updated parameters,
            written in place, in its own dtype.
        flat_grad: (n,) this rank's gradient (of the mean loss on its slice of the batch),
            laid out as ``flat_params``, in the same dtype, zeros in the padding.
        state: a dict kept from step to step, empty at the first step. Keep in it an
            **fp32** master copy of this rank's shard of the parameters (elements
            ``[rank * n // world_size, (rank + 1) * n // world_size)``) and a
            ``torch.optim.Adam(..., lr=lr)`` over that master alone: the master (4 bytes)
            and Adam's two fp32 moments (4 + 4) make K = 12 bytes per element of the
            shard, K Psi / Nd per rank (Sec 3.1, Sec 5.1). Adam steps the master, never
            the bf16 parameters: a bf16 update smaller than the parameter's last bit is lost.
        world_size: the number of ranks, Nd.
        rank: this rank.
        lr: Adam's learning rate.
        reduced: keyword, default False. True: ``flat_grad`` is already this rank's
            (n // world_size,) shard, averaged over the ranks (ZeRO-2 and ZeRO-3 reduce
            the gradient during backward, chapters 3 and 4): step with it, do not
            reduce it again.
        gather: keyword, default True. False: ``flat_params`` is this rank's
            (n // world_size,) shard alone (ZeRO-3 keeps only that, chapter 4): write the
            updated master into it, with no all-gather.

    Returns:
        (n // world_size,) fp32: the averaged gradient of this rank's shard, the one
        Adam stepped with.

    Move data with ``dist.reduce_scatter_single(output, input)`` and ``dist.all_gather_single(output,
    input)`` only (output and input of one dtype): ZeRO-1 moves 2 Psi per step, as DP
    does (Sec 1, Sec 7).
    """
    # BEGIN SOLUTION
    n = flat_grad.numel() if reduced else flat_grad.numel() // world_size  # this rank's shard
    if not state:  # the first step: an fp32 master of this rank's shard, and Adam over it alone
        mine = flat_params[rank * n:(rank + 1) * n] if gather else flat_params
        state["master"] = nn.Parameter(mine.detach().to(torch.float32, copy=True))
        state["adam"] = torch.optim.Adam([state["master"]], lr=lr)
    master, adam = state["master"], state["adam"]
    if reduced:
        grad = flat_grad.float()
    else:
        grad = torch.empty(n, dtype=flat_grad.dtype)
        dist.reduce_scatter_single(grad, flat_grad)  # the sum over ranks of this rank's shard only
        grad = grad.float() / world_size  # averaged in fp32, where Adam works
    master.grad = grad
    adam.step()
    master.grad = None
    working = master.detach().to(flat_params.dtype)  # bf16 (or fp32) again, for the forward
    if gather:
        dist.all_gather_single(flat_params, working)  # every rank's updated shard, on every rank
    else:
        flat_params.copy_(working)
    return grad
    # END SOLUTION
