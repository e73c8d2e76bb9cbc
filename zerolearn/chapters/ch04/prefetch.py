"""Exercise ``04.prefetch``: ZeRO-3's prefetch, in forward and in backward (paper Sec 5.3).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch04.prefetch_check`; it is also
stage 3's gathering in :mod:`zerolearn.nano` (``prefetch=True``).
"""

import torch.distributed as dist


def prefetch(units, flats, shards, world_size):
    """Gather each unit before its forward and its backward, the next unit's all-gather already in flight (Sec 5.3).

    Args:
        units: list of nn.Modules in the order forward runs them (here Linear layers);
            backward runs them in the reverse order.
        flats: list; flats[i] holds units[i]'s parameters laid end to end, fp32 or bf16,
            1-D, world_size * shards[i].numel() elements (zero-padded); units[i]'s
            parameters are views of it. Between uses its storage holds 0 bytes.
        shards: list; shards[i] is this rank's slice of flats[i], of its dtype, 1-D.
        world_size: the number of data-parallel ranks, Nd.

    To launch unit j's all-gather, grow flats[j]'s storage back to
    ``flats[j].numel() * flats[j].element_size()`` bytes (``untyped_storage().resize_(nbytes)``)
    and call ``dist.all_gather_single(flats[j], shards[j], async_op=True)``: it returns a handle
    whose ``.wait()`` blocks until the data is there. To free unit j, resize its storage
    to 0 bytes. Register on each units[i]:

    * a forward pre-hook that makes sure units[i] is gathered (waiting for its all-gather
      if one is in flight, launching one and waiting if none is), then launches
      units[i + 1]'s all-gather without waiting;
    * a forward hook (it must return None) that frees units[i] and, when the output
      requires grad (a training forward; an evaluation under torch.no_grad() has no
      backward), registers ``output.register_hook(fn)``: autograd calls ``fn(grad)``
      just before units[i]'s backward. There, do as the pre-hook does in the other
      direction: make sure units[i] is gathered, then launch units[i - 1]'s all-gather;
    * on each parameter, ``p.register_post_accumulate_grad_hook(hook)``: once every
      parameter of units[i] has its gradient, free units[i].

    Every unit is gathered twice per training step (2 Psi; with the gradients'
    reduce-scatter, 3 Psi, Sec 7.2.2) and at most two units are gathered at once.
    Returns None.
    """
    # BEGIN SOLUTION
    handles = {}

    def start(j):
        flats[j].untyped_storage().resize_(flats[j].numel() * flats[j].element_size())
        handles[j] = dist.all_gather_single(flats[j], shards[j], async_op=True)

    def ready(i, following):
        if i not in handles:
            start(i)  # nothing prefetched it: the first unit of the pass
        handles.pop(i).wait()
        if 0 <= following < len(units):
            start(following)  # in flight while units[i] computes

    def free(i):
        flats[i].untyped_storage().resize_(0)

    def after_forward(i, output):
        free(i)
        if output.requires_grad:  # backward will need units[i] again; it runs the units in reverse
            output.register_hook(lambda grad: ready(i, i - 1))

    arrived = [0] * len(units)

    def after_grad(i):
        arrived[i] += 1
        if arrived[i] == len(list(units[i].parameters())):  # backward is done with units[i]
            arrived[i] = 0
            free(i)

    for i, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda module, args, i=i: ready(i, i + 1))
        unit.register_forward_hook(lambda module, args, output, i=i: after_forward(i, output))
        for p in unit.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: after_grad(i))
    # END SOLUTION
