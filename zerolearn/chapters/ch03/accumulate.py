"""Exercise ``03.accumulate``: gradient accumulation in ZeRO-2 (paper Sec 5.2).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch03.accumulate_check`.
"""

import torch
import torch.distributed as dist


def accumulate(shard, bucket_grad, micro_batch, micro_batches, world_size):
    """Reduce one micro-batch's bucket gradient and accumulate it into this rank's shard.

    Args:
        shard: fp32, 1-D, n elements: this rank's gradient shard of the bucket. At
            micro_batch 0 it still holds the previous step's gradient.
        bucket_grad: fp32, 1-D, world_size * n elements: the bucket's flat, zero-padded
            gradient of this rank's loss on this micro-batch (a mean over its samples).
        micro_batch: which micro-batch of the step this is, 0 ... micro_batches - 1.
        micro_batches: micro-batches per step.
        world_size: the number of data-parallel ranks, Nd.

    After the step's last micro-batch, ``shard`` must hold this rank's slice of the
    step's gradient: the mean of ``bucket_grad`` over the world_size ranks and the
    micro_batches micro-batches. Reduce every micro-batch at once with one
    ``dist.reduce_scatter_single(output, input)`` (ZeRO-2 keeps only the shard between
    micro-batches). Returns None.
    """
    # BEGIN SOLUTION
    part = torch.empty_like(shard)
    dist.reduce_scatter_single(part, bucket_grad)
    part /= world_size * micro_batches
    if micro_batch == 0:
        shard.copy_(part)  # a new step: the previous step's gradient goes
    else:
        shard.add_(part)
    # END SOLUTION
