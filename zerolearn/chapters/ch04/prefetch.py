"""Exercise ``04.prefetch``: ZeRO-3's prefetch (paper Sec 5.3).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch04.prefetch_check`.
"""

from zerolearn import comm


def prefetch(units, flats, shards, world_size):
    """Gather each unit before its forward, with the next unit's all-gather already in flight (Sec 5.3).

    Args:
        units: list of nn.Modules in the order forward runs them (here Linear layers).
        flats: list; flats[i] holds units[i]'s parameters laid end to end, fp32, 1-D,
            world_size * shards[i].numel() elements (zero-padded); units[i]'s parameters
            are views of it. Between uses its storage holds 0 bytes.
        shards: list; shards[i] is this rank's slice of flats[i], fp32, 1-D.
        world_size: the number of data-parallel ranks, Nd.

    The forward runs under torch.no_grad() (an evaluation pass): a unit can be freed
    as soon as its forward returns. Register on each units[i] a forward pre-hook that
    makes sure units[i] is gathered (waiting for its all-gather if one is in flight,
    gathering it now if none is) and then launches units[i + 1]'s all-gather without
    waiting: grow flats[i + 1]'s storage back to flats[i + 1].numel() * 4 bytes
    (``untyped_storage().resize_(nbytes)``) and call ``comm.all_gather(flats[i + 1],
    shards[i + 1], async_op=True)``, which returns a handle whose ``.wait()`` blocks
    until the data is there. And a forward hook that frees units[i]:
    ``flats[i].untyped_storage().resize_(0)`` (a forward hook must return None).
    Returns None.
    """
    # BEGIN SOLUTION
    handles = {}

    def start(i):
        flats[i].untyped_storage().resize_(flats[i].numel() * flats[i].element_size())
        handles[i] = comm.all_gather(flats[i], shards[i], async_op=True)

    def before_forward(i):
        if i not in handles:
            start(i)  # nothing prefetched it: the first unit
        handles.pop(i).wait()
        if i + 1 < len(units):
            start(i + 1)  # in flight while units[i] computes

    def after_forward(i):
        flats[i].untyped_storage().resize_(0)

    for i, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda module, args, i=i: before_forward(i))
        unit.register_forward_hook(lambda module, args, output, i=i: after_forward(i))
    # END SOLUTION
