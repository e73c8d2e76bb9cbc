"""Exercise ``00.model_state_bytes``: the model states of one replica (paper Sec 3.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch00.model_state_bytes_check`.
"""


def model_state_bytes(psi, optimizer, dtype):
    """Bytes of model states one data-parallel replica holds (paper Sec 3.1).

    Args:
        psi: trainable parameters, an int.
        optimizer: ``"adam"`` (two fp32 moments: momentum and variance),
            ``"sgd_momentum"`` (one fp32 momentum buffer) or ``"sgd"`` (no state).
        dtype: the working dtype of parameters and gradients: ``"fp32"`` (4 bytes),
            ``"bf16"`` or ``"fp16"`` (2 bytes, mixed precision).

    Returns:
        ``{"params": ..., "grads": ..., "optimizer_states": ...}``, ints, in bytes.
        Mixed precision keeps an fp32 master copy of the parameters for the update,
        which the paper counts in the optimizer states' K bytes per parameter;
        in fp32 the working parameters are that copy.
    """
    # BEGIN SOLUTION
    width = 4 if dtype == "fp32" else 2
    master = 0 if dtype == "fp32" else 4
    moments = {"adam": 8, "sgd_momentum": 4, "sgd": 0}[optimizer]
    return {"params": width * psi, "grads": width * psi, "optimizer_states": (master + moments) * psi}
    # END SOLUTION
