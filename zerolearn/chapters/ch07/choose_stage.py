"""Exercise ``07.choose_stage``: the lowest stage that fits, residual states included (paper Sec 3.2, 5).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch07.choose_stage_check`.
"""


def choose_stage(psi, device_bytes, nd, residual_bytes=0):
    """The lowest ZeRO stage that fits ``psi`` parameters on the ``nd`` GPUs you have.

    Per device: the model states of the stage (bf16 and Adam: 2 + 2 + K bytes per
    parameter with K = 12, of which stage 1 divides the K by ``nd``, stage 2 also the
    gradients' 2, stage 3 all of them; Sec 5) plus ``residual_bytes`` (activations,
    temporary buffers: ZeRO-DP does not divide them, Sec 3.2). The lowest stage that
    fits moves the least data: stages 1 and 2 move DP's 2 Psi, stage 3 3 Psi (Sec 7).

    Args:
        psi: parameters (a number > 0).
        device_bytes: memory per GPU in bytes (decimal: 32 GB is 32e9).
        nd: the number of GPUs (data-parallel degree), an int >= 1.
        residual_bytes: bytes per GPU besides model states.

    Returns:
        The stage, an int 0-3, or None when no stage fits.
    """
    # BEGIN SOLUTION
    for stage, per_param in enumerate((16, 4 + 12 / nd, 2 + 14 / nd, 16 / nd)):
        if per_param * psi + residual_bytes <= device_bytes:
            return stage
    return None
    # END SOLUTION
