"""Exercise ``01.average_gradients``: naive data parallelism (paper Sec 2.1, Sec 7.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch01.average_gradients_check`.
"""

import torch.distributed as dist


def average_gradients(model, world_size):
    """Average every gradient of ``model`` over the ranks, in place, after ``loss.backward()``.

    Args:
        model: an ``nn.Module``, the same on every rank; each trainable parameter ``p``
            holds in ``p.grad`` the gradient of this rank's loss (fp32, shaped as ``p``).
        world_size: the number of ranks, Nd.

    On return every ``p.grad`` holds the mean of the ranks' gradients: the gradient of
    the whole global batch. Use ``dist.all_reduce(tensor)``, torch's all-reduce: it sums
    ``tensor`` in place over the ranks. Leave the parameters alone.
    """
    # BEGIN SOLUTION
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # the sum over ranks, on every rank
            p.grad.div_(world_size)
    # END SOLUTION
