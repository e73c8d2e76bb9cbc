"""Exercise ``02.shard_range``: flat padded shards (paper Sec 5.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch02.shard_range_check`.
"""


def shard_range(psi, world_size, rank):
    """This rank's shard of a flat buffer of ``psi`` elements split over ``world_size`` ranks.

    The buffer is padded with zeros at its end up to the next multiple of ``world_size``
    (no padding when ``psi`` already is one), and rank r owns the r-th of ``world_size``
    equal, contiguous slices of the padded buffer.

    Args:
        psi: elements in the buffer, an int >= 1.
        world_size: the number of ranks, Nd, an int >= 1.
        rank: this rank, 0 <= rank < world_size.

    Returns:
        ``(start, end, padding)``, ints: the shard is elements ``[start, end)`` of the
        padded buffer; ``padding`` is how many zeros were appended (the same on every rank).
    """
    # BEGIN SOLUTION
    padding = -psi % world_size
    shard = (psi + padding) // world_size
    return rank * shard, (rank + 1) * shard, padding
    # END SOLUTION
