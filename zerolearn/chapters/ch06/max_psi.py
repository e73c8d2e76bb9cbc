"""Exercise ``06.max_psi``: the largest model a device holds, per stage (paper Sec 5, Table 2).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch06.max_psi_check`.
"""


def max_psi(device_bytes, nd, stage, nm=1, k=12):
    """The largest Psi (parameters) whose model states fit one device (Sec 5, Table 2).

    Mixed precision: 2-byte parameters and gradients, ``k`` bytes of optimizer state per
    parameter (12 for Adam). Model parallelism of degree ``nm`` gives each device Psi / nm
    of the parameters; ZeRO then divides by ``nd`` what the stage partitions: stage 0
    (DP) nothing, 1 (P_os) the optimizer states, 2 (P_os+g) also the gradients, 3
    (P_os+g+p) also the parameters. Activations and buffers are left out, as in
    Table 2's theoretical column.

    Args:
        device_bytes: memory per device in bytes (decimal: 32 GB is 32e9).
        nd: data-parallel degree, an int >= 1.
        stage: 0, 1, 2 or 3.
        nm: model-parallel degree, an int >= 1.
        k: optimizer bytes per parameter.

    Returns:
        The largest Psi, a float (not rounded).
    """
    # BEGIN SOLUTION
    params, grads, states = 2, 2, k  # bytes per parameter, before any partitioning
    if stage >= 1:
        states /= nd
    if stage >= 2:
        grads /= nd
    if stage >= 3:
        params /= nd
    return device_bytes * nm / (params + grads + states)
    # END SOLUTION
