"""Exercise ``04.gather_hooks``: ZeRO-3's gather and free around each unit (paper Sec 5.3, 7.2.2).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch04.gather_hooks_check`.
"""

import torch.distributed as dist


def gather_hooks(unit, flat, shard, world_size):
    """Gather ``unit``'s parameters just before its forward and its backward; free them after each (Sec 5.3).

    Args:
        unit: an nn.Module (here a Linear layer) whose parameters are views of ``flat``.
        flat: fp32, 1-D, world_size * shard.numel() elements: the unit's parameters laid
            end to end, zero-padded. Between uses its storage holds 0 bytes.
        shard: fp32, 1-D: this rank's slice of ``flat`` (elements rank * shard.numel()
            onwards), the only copy of the parameters a rank keeps; the optimizer updates
            it between steps.
        world_size: the number of data-parallel ranks, Nd.

    To gather, grow flat's storage back, ``flat.untyped_storage().resize_(flat.numel() * 4)``
    (bytes), and ``dist.all_gather_single(flat, shard)`` into it; to free, resize it to 0 bytes.
    Register on ``unit``: a forward pre-hook that gathers; a forward hook that frees and
    registers a hook on the output (``output.register_hook(fn)``: autograd calls
    ``fn(grad)`` just before the unit's backward) that gathers again; and a
    ``p.register_post_accumulate_grad_hook`` on each parameter that frees the unit once
    all of them have their gradient. Returns None.
    """
    # BEGIN SOLUTION
    params = list(unit.parameters())
    arrived = []

    def gather(*_):
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        dist.all_gather_single(flat, shard)

    def free():
        flat.untyped_storage().resize_(0)

    def after_forward(module, inputs, output):
        free()
        if output.requires_grad:
            output.register_hook(gather)  # runs just before this unit's backward

    def after_grad(p):
        arrived.append(p)
        if len(arrived) == len(params):  # backward is done with the unit
            arrived.clear()
            free()

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(after_grad)
    # END SOLUTION
