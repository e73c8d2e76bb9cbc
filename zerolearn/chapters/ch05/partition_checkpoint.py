"""Exercise ``05.partition_checkpoint``: ZeRO-R's partitioned checkpoints, P_a (paper Sec 6.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch05.partition_checkpoint_check`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def partition_checkpoint(x, group):
    """Keep this rank's 1/Nm of the checkpoint ``x``; return a function that gives all of ``x`` back (P_a, Sec 6.1).

    Args:
        x: a checkpointed block's input, fp32, any shape (here 31 tokens x 61 features),
            the same on the Nm ranks of ``group``: under model parallelism every rank of
            a block computes the block's whole input.
        group: the Nm model-parallel ranks: ``dist.get_rank(group)``,
            ``dist.get_world_size(group)``.

    Keep piece r = elements r * c ... (r + 1) * c - 1 of x flattened, zero-padded at
    the end, c = ceil(x.numel() / Nm), and no reference to x or to a view of x: a
    view keeps x's whole storage alive. Return ``restore()``: a function of no
    arguments that gathers the pieces into a tensor of c * Nm elements with one
    ``dist.all_gather_single(output, piece, group=group)`` and returns a tensor
    equal to x, of x's shape. Backward calls it once, just before it recomputes the block.
    """
    # BEGIN SOLUTION
    nm, rank = dist.get_world_size(group), dist.get_rank(group)
    shape, numel = x.shape, x.numel()
    c = -(-numel // nm)  # ceil(numel / nm) in integers
    padded = F.pad(x.detach().reshape(-1), (0, c * nm - numel))
    piece = padded[rank * c:(rank + 1) * c].clone()  # a copy: a view would keep all of `padded`
    del padded

    def restore():
        full = torch.empty(c * nm, dtype=piece.dtype)
        dist.all_gather_single(full, piece, group=group)
        return full[:numel].view(shape)

    return restore
    # END SOLUTION
