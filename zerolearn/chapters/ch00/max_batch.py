"""Exercise ``00.max_batch``: the largest batch that fits beside the model states (paper Sec 3.2).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch00.max_batch_check`.
"""


def max_batch(psi, device_bytes, hidden, seq_len, layers, checkpointing=False):
    """The largest batch (sequences per step) that fits on one device beside the model states.

    Model states: mixed-precision Adam, 16 bytes per parameter (Sec 3.1). Activations:
    12 x hidden x batch x seq_len x layers values of 2 bytes (Sec 3.2), or with
    ``checkpointing`` (one checkpoint per transformer block) hidden x batch x seq_len
    x layers values. Temporary buffers and fragmentation are left out.

    Args:
        psi: trainable parameters, an int.
        device_bytes: memory of the device in bytes (decimal: 32 GB is 32e9).
        hidden, seq_len, layers: the transformer's width, sequence length and depth, ints.
        checkpointing: whether activations are checkpointed, one per block.

    Returns:
        The largest int ``batch`` >= 0 whose model states plus activations are at
        most ``device_bytes``; 0 when not even the model states fit.
    """
    # BEGIN SOLUTION
    left = device_bytes - 16 * psi
    per_sequence = (1 if checkpointing else 12) * hidden * seq_len * layers * 2
    return max(0, int(left // per_sequence))
    # END SOLUTION
