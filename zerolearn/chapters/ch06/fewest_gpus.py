"""Exercise ``06.fewest_gpus``: the fewest GPUs, then the lowest stage, that hold a model (paper Sec 5, 7).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch06.fewest_gpus_check`.
"""


def fewest_gpus(psi, device_bytes, max_nd=1024):
    """The fewest GPUs, then the lowest ZeRO stage, whose model states hold ``psi`` parameters.

    Model states only, bf16 with Adam: 2 + 2 + K bytes per parameter with K = 12, of
    which stage 1 divides the K by Nd, stage 2 also the gradients' 2, stage 3 all of them
    (Sec 5). Try Nd = 1, 2, ... up to ``max_nd``; at the first Nd where some stage fits
    (bytes per device <= ``device_bytes``), take the lowest such stage: lower stages
    partition less and never move more data (Sec 7).

    Args:
        psi: parameters (a number > 0).
        device_bytes: memory per device in bytes (decimal: 80 GB is 80e9).
        max_nd: the most GPUs to consider, an int >= 1.

    Returns:
        ``(stage, nd)``, two ints, or None when no stage fits on ``max_nd`` GPUs.
    """
    # BEGIN SOLUTION
    for nd in range(1, max_nd + 1):
        for stage, per_param in enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd)):
            if per_param * psi <= device_bytes:
                return stage, nd
    return None
    # END SOLUTION
