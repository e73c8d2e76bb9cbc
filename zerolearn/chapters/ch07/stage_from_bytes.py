"""Exercise ``07.stage_from_bytes``: which ZeRO stage a rank runs, read from its bytes (paper Sec 5.1-5.3).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch07.stage_from_bytes_check`.
"""


def stage_from_bytes(held, full):
    """The ZeRO stage (0-3) a rank runs, read from the model-state bytes it holds.

    A state is partitioned when the rank holds less of it than a full replica does,
    however unequal the shards (``ZeroRedundancyOptimizer`` gives whole tensors to
    ranks, so one rank may hold most of it). Stage 0 partitions nothing, 1 the
    optimizer states, 2 also the gradients, 3 also the parameters (Sec 5.1-5.3).

    Args:
        held: ``{"params": ..., "grads": ..., "optimizer_states": ...}``, bytes one rank holds.
        full: the same three, in bytes, for one unpartitioned replica (what DP holds).

    Returns:
        The stage, an int 0-3.

    Raises:
        ValueError: the partitioned states match no stage (e.g. gradients partitioned,
            optimizer states whole).
    """
    # BEGIN SOLUTION
    parted = tuple(held[c] < full[c] for c in ("optimizer_states", "grads", "params"))
    stages = {(False, False, False): 0, (True, False, False): 1, (True, True, False): 2, (True, True, True): 3}
    if parted not in stages:
        raise ValueError(f"no ZeRO stage partitions exactly these states: {held} of {full}")
    return stages[parted]
    # END SOLUTION
