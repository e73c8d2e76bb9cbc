"""Exercise ``03.reduce_scatter_hook``: ZeRO-2's bucket hook (paper Sec 5.2).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch03.reduce_scatter_hook_check`.
"""

import torch
import torch.distributed as dist


def reduce_scatter_hook(bucket, shard, world_size):
    """Make backward reduce-scatter ``bucket``'s gradients into ``shard`` and free them (Sec 5.2).

    Args:
        bucket: list of fp32 parameters. Laid end to end in this order their gradients
            form a flat buffer of n = sum(p.numel()) elements, padded with zeros to
            world_size * shard.numel() elements.
        shard: fp32, 1-D, ceil(n / world_size) elements: this rank's slice of that flat
            buffer (elements rank * shard.numel() onwards), averaged over the ranks.
        world_size: the number of data-parallel ranks, Nd.

    Register a hook on every parameter, ``p.register_post_accumulate_grad_hook(hook)``:
    autograd calls ``hook(p)`` once ``p.grad`` holds p's gradient. When the last
    parameter of the bucket has its gradient (in every backward), write the mean over
    ranks of this rank's slice into ``shard`` with one ``dist.reduce_scatter_single(output,
    input)`` and free the bucket's full gradients (``p.grad = None``): ZeRO-2 keeps
    only the shard. Returns None.
    """
    # BEGIN SOLUTION
    ready = []

    def hook(p):
        ready.append(p)
        if len(ready) < len(bucket):
            return
        ready.clear()
        flat = torch.zeros(shard.numel() * world_size)
        torch.cat([q.grad.flatten() for q in bucket], out=flat[:sum(q.numel() for q in bucket)])
        for q in bucket:
            q.grad = None  # the full gradient goes; only the shard stays
        dist.reduce_scatter_single(shard, flat)
        shard.div_(world_size)

    for p in bucket:
        p.register_post_accumulate_grad_hook(hook)
    # END SOLUTION
