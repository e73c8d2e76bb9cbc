"""Exercise ``01.broadcast_model``: DDP's start-up broadcast (paper Sec 2.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch01.broadcast_model_check`.
"""

import torch.distributed as dist


def broadcast_model(model):
    """Make this rank's ``model`` a copy of rank 0's, in place, as DDP does when it wraps a model.

    Args:
        model: an ``nn.Module`` of the same architecture on every rank, its values
            different (initialised from another seed, say): parameters and buffers
            (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``), any dtype.

    On return every parameter and buffer holds rank 0's values, in the same tensors (an
    optimizer built before still steps them); rank 0's are unchanged. Use
    ``dist.broadcast(tensor, src=0)``: rank 0 sends ``tensor``, every other rank receives
    into its ``tensor``, in place.
    """
    # BEGIN SOLUTION
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=0)  # .data: writing into a leaf that requires grad
    # END SOLUTION
