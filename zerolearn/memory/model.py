"""The paper's analytic memory and communication model, one function per quantity.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC'20 (arXiv 1910.02054). Each function cites its section.

Units: memory in bytes, communication in elements (numbers moved, not bytes).
Results are ints when the arithmetic is exact on ints, floats otherwise (e.g.
psi=7.5e9 or a shard that Nd does not divide); nothing is rounded.

GB convention: the paper's GB and TB are decimal (1 GB = 10**9 bytes). Only that
reproduces its numbers: 7.5B params x 16 bytes = 120 GB exactly (Fig 1), and a 32 GB
V100 holds 32e9 / 4.1875 = 7.6B params under P_os at Nd = 64 (Table 2); with 2**30
both would be off by 7%. Stage numbers follow DeepSpeed: 0 = DP baseline,
1 = P_os, 2 = P_os+g, 3 = P_os+g+p.
"""

from __future__ import annotations

__all__ = [
    "FIGURE1_GB", "GB", "STAGE_NAMES", "TABLE1_GB", "TABLE2_THEORETICAL_B",
    "V100_BYTES", "activation_bytes", "comm_collectives_elements",
    "comm_volume_elements", "constant_buffer_bytes", "dtype_bytes",
    "fused_buffer_bytes", "max_model_params", "model_state_bytes",
    "mp_allreduce_elements_per_block", "offload_state_bytes", "optimizer_k", "pa_allgather_elements_per_block",
    "pa_overhead_ratio", "partitioned_checkpoint_bytes", "stage_title",
]

GB = 10**9
"""The paper's gigabyte in bytes (decimal; see the module docstring)."""

V100_BYTES = 32 * GB
"""Device memory the paper assumes for Table 2 (32 GB V100), in bytes."""

STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
"""The paper's name of each stage (Sec 5.1, Fig 1), by DeepSpeed's stage number."""

FIGURE1_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
"""Fig 1 as printed: GB per device for psi = 7.5e9, Nd = 64, K = 12, by stage."""

TABLE1_GB = {
    7_500_000_000: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
                    64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47),
                    1024: (30.1, 15.1, 0.12)},
    128_000_000_000: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128),
                      64: (536, 284, 32), 256: (518, 263, 8), 1024: (513, 257, 2)},
    1_000_000_000_000: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000),
                        16: (4750, 2875, 1000), 64: (4187, 2218, 250),
                        256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}
"""Table 1's cells: {psi: {Nd: (P_os, P_os+g, P_os+g+p)}} in GB per device, K = 12.

Table 1 is an image in the paper, in every text copy of it; these values are a
transcription, and the formula of Fig 1 gives each of them to the digits shown. The
table sometimes truncates rather than rounds (4187.5 appears as 4187), so a recomputed
value lies within one unit of the last digit."""

TABLE2_THEORETICAL_B = {
    (1, 64): (2, 7.6, 14.4, 128), (2, 128): (4, 15.2, 28.8, 256),
    (4, 256): (8, 30.4, 57.6, 500), (8, 512): (16, 60.8, 115.2, 1000),
    (16, 1024): (32, 121.6, 230.4, 2000),
}
"""Table 2's theoretical column as printed: {(MP degree, GPUs): max psi per stage 0-3}
in billions of parameters, on 32 GB V100s (so Nd = GPUs / MP = 64 throughout).

Printed coarsely: the trillions to one digit ("0.5T", "1T", "2T", kept here as 500, 1000
and 2000, where the formula gives 512B, 1,024B and 2,048B, 2.4% more), and rows with
MP > 1 scale the MP = 1 row's rounded values (121.6 = 16 x 7.6, exact 122.3), so
recomputed values agree to ~3%."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OPTIMIZERS = ("adam", "adamw", "sgd")


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_real(name: str, value: float, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    # `not value >= 0` also rejects NaN.
    if not ok or not value >= 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


def _check_stage(stage: int) -> None:
    if isinstance(stage, bool) or stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0, 1, 2 or 3 ({STAGE_NAMES}), got {stage!r}")


def stage_title(stage: int) -> str:
    """DeepSpeed's name and the paper's for ``stage`` 0-3: "DP", "ZeRO-1 (P_os)", ...

    Raises:
        ValueError: ``stage`` not in 0-3.
    """
    _check_stage(stage)
    return "DP" if stage == 0 else f"ZeRO-{stage} ({STAGE_NAMES[stage]})"


def _div(numerator: float, denominator: int) -> int | float:
    """Exact division: an int when both are ints and it divides, else a float."""
    if isinstance(numerator, int) and numerator % denominator == 0:
        return numerator // denominator
    return numerator / denominator


def _block_message(seq_len: int, batch: int, hidden: int) -> int:
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden)):
        _check_int(name, value, 1)
    return seq_len * batch * hidden


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name: fp32 -> 4, bf16 -> 2, fp16 -> 2.

    Raises ValueError for any other name. Sec 3.1 (fp16 = 2 bytes, fp32 = 4 bytes).
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    return _DTYPE_BYTES[dtype]


def optimizer_k(optimizer: str, dtype: str, momentum: bool = True) -> int:
    """K: bytes of optimizer state per parameter (Sec 3.1).

    Mixed precision (bf16/fp16 working params) adds a 4-byte fp32 master copy,
    which the paper counts in K: Adam(W) 4 + 4 + 4 = 12; SGD 4 (+ 4 for momentum).
    Pure fp32 training needs no master copy: Adam(W) 8, SGD 4 or 0.
    `momentum` applies to SGD only; Adam always keeps both moments.

    Raises ValueError for an optimizer outside {"adam", "adamw", "sgd"} or a dtype
    outside {"fp32", "bf16", "fp16"}.
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
    master = 0 if dtype_bytes(dtype) == 4 else 4
    moments = 8 if optimizer in ("adam", "adamw") else (4 if momentum else 0)
    return master + moments


def model_state_bytes(psi: float, nd: int, stage: int, k: float = 12,
                      param_bytes: float = 2, grad_bytes: float = 2,
                      nm: int = 1) -> dict[str, int | float]:
    """Bytes of model states held by one device (Sec 3.1, Sec 5, Fig 1, Table 1).

    Model parallelism of degree `nm` leaves psi / nm parameters per device (Sec 1,
    Table 2); ZeRO-DP then divides by Nd what each stage partitions. With fp16
    params and grads (2 and 2 bytes): stage 0 (2 + 2 + K) psi; stage 1
    (2 + 2) psi + K psi / Nd; stage 2 2 psi + (2 + K) psi / Nd; stage 3
    (2 + 2 + K) psi / Nd. param_bytes and grad_bytes generalise the 2s.

    Args: psi parameters (>= 0); nd data-parallel degree (int >= 1); stage 0-3;
    k optimizer bytes per parameter (>= 0, see `optimizer_k`); param_bytes and
    grad_bytes bytes per element (> 0); nm model-parallel degree (int >= 1).
    Returns {"params", "grads", "optimizer_states", "total"} in bytes, unrounded
    (ints when exact). Padding of shards is not modelled. Raises ValueError.
    """
    _check_real("psi", psi)
    _check_int("nd", nd, 1)
    _check_stage(stage)
    _check_real("k", k)
    _check_real("param_bytes", param_bytes, positive=True)
    _check_real("grad_bytes", grad_bytes, positive=True)
    _check_int("nm", nm, 1)
    params = _div(param_bytes * psi, nm * nd if stage >= 3 else nm)
    grads = _div(grad_bytes * psi, nm * nd if stage >= 2 else nm)
    opt = _div(k * psi, nm * nd if stage >= 1 else nm)
    return {"params": params, "grads": grads, "optimizer_states": opt,
            "total": params + grads + opt}


OFFLOADS = (None, "cpu", "disk")
"""Where offload may put the optimizer states (ZeRO-Offload: host memory; ZeRO-Infinity: disk)."""


def offload_state_bytes(psi: float, nd: int, stage: int, offload: str | None,
                        dtype: str = "bf16", k: float = 12) -> dict[str, dict[str, int | float]]:
    """Bytes of model states per rank by location, with the optimizer offloaded.

    Sec 5's per-device formulas (:func:`model_state_bytes`) extended to offload as
    ZeRO-Offload (Ren et al., USENIX ATC 2021, arXiv 2101.06840, Sec 4: 2-byte
    parameters on the GPU; gradients, fp32 optimizer states and the update on the CPU)
    and ZeRO-Infinity (Rajbhandari et al., SC'21, arXiv 2104.07857, Sec 5: ZeRO-3's
    optimizer states on CPU memory or NVMe) place them, as the engines of
    :mod:`zerolearn.engines.offload` hold them. With w = bytes of ``dtype``:

    * ``offload=None``: the device holds :func:`model_state_bytes` (params, grads,
      optimizer_states with param_bytes = grad_bytes = w); host and disk hold 0.
    * ``"cpu"``: device params w Psi (w Psi / Nd at stage 3); device grads w Psi at
      stage 1 (P_os keeps the full gradient) and 0 at stages 2-3 (each reduced shard
      moves to the host as its reduction finishes; the buckets being reduced are
      temporary, as in Sec 5.2); device optimizer states 0. Host grads 4 Psi / Nd
      (the shard the step reads, in fp32, as DeepSpeed keeps it) and host optimizer
      states K Psi / Nd.
    * ``"disk"``: as "cpu", with the optimizer states on disk, K Psi / Nd, and none in
      host memory between steps (one bucket's while it steps). At stage 3 the working
      parameter shards are on disk too, w Psi / Nd, and none on the device between uses
      (a unit's shards are read for its gathers and released after).

    The extension beyond the papers' text: the fp32 gradient buffer (ZeRO-Offload's
    figures count 2-byte gradients moved to the CPU).

    Args: psi parameters (>= 0, add padding to compare with a measurement); nd
    data-parallel degree (int >= 1); stage 0-3 (1-3 with offload); offload None,
    "cpu" or "disk"; dtype of the working parameters and gradients ("fp32", "bf16",
    "fp16"); k optimizer bytes per parameter *including the fp32 master*: with offload
    the master is always a tensor of its own, in fp32 training too (without offload
    it shares the working parameters' storage there), so pass
    ``optimizer_k(optimizer, "bf16")`` (Adam: 12) for fp32 runs as well.

    Returns {"device" | "host" | "disk": {"params", "grads", "optimizer_states"}} in
    bytes, unrounded (ints when exact).

    Raises ValueError: bad numbers, an offload outside :data:`OFFLOADS`, or offload at
    stage 0.
    """
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    w = dtype_bytes(dtype)
    plain = model_state_bytes(psi, nd, stage, k, w, w)
    zero = {"params": 0, "grads": 0, "optimizer_states": 0}
    if offload is None:
        return {"device": {c: plain[c] for c in zero}, "host": dict(zero), "disk": dict(zero)}
    if stage == 0:
        raise ValueError("offload needs stage 1, 2 or 3 (stage 0 partitions nothing), got stage 0")
    states = _div(k * psi, nd)
    params_on_disk = offload == "disk" and stage == 3
    device = {"params": 0 if params_on_disk else plain["params"], "grads": plain["grads"] if stage == 1 else 0,
              "optimizer_states": 0}
    host = {"params": 0, "grads": _div(4 * psi, nd), "optimizer_states": states if offload == "cpu" else 0}
    disk = {"params": plain["params"] if params_on_disk else 0, "grads": 0,
            "optimizer_states": states if offload == "disk" else 0}
    return {"device": device, "host": host, "disk": disk}


def max_model_params(device_bytes: float, nd: int, stage: int, k: float = 12,
                     nm: int = 1, param_bytes: float = 2,
                     grad_bytes: float = 2) -> float:
    """Largest psi (parameters) whose model states fit in `device_bytes` per device.

    Solves `model_state_bytes(psi, ...)["total"] == device_bytes` for psi; the
    total is linear in psi. Residual memory (activations, buffers) is ignored, as
    in Table 2's theoretical column. Raises ValueError on bad inputs.
    """
    _check_real("device_bytes", device_bytes)
    per_param = model_state_bytes(1.0, nd, stage, k, param_bytes, grad_bytes, nm)
    return device_bytes / per_param["total"]


def activation_bytes(hidden: int, batch: int, seq_len: int, layers: int,
                     bytes_per_value: int = 2, checkpointing: bool = False) -> int:
    """Activation bytes of a GPT-2-like transformer per device (Sec 3.2).

    Without checkpointing: 12 x hidden x batch x seq_len x layers values (Sec 3.2,
    footnote); GPT-2 1.5B (48 layers, hidden 1600) at seq 1K, batch 32 in fp16 is
    60.4e9 bytes, the paper's "about 60 GB". With one checkpoint per transformer
    block (the input of each block, as Sec 6.1 and Sec 8 assume): batch x seq_len x
    hidden values per layer, 12x fewer: 5.0e9 bytes for that example. The paper's
    "about 8 GB" there is not derived from a formula (it cites square-root
    checkpointing); recomputing one block during backward adds 12 x b x s x h
    values on top (6.3e9 bytes), still within it.

    Args are positive ints. Raises ValueError otherwise.
    """
    for name, value in (("hidden", hidden), ("batch", batch), ("seq_len", seq_len),
                        ("layers", layers), ("bytes_per_value", bytes_per_value)):
        _check_int(name, value, 1)
    per_layer = batch * seq_len * hidden * (1 if checkpointing else 12)
    return per_layer * layers * bytes_per_value


def partitioned_checkpoint_bytes(hidden: int, batch: int, seq_len: int, layers: int,
                                 nm: int, bytes_per_value: int = 2) -> int | float:
    """Activation-checkpoint bytes per device under P_a (Sec 6.1).

    MP replicates each block's input checkpoint on all Nm ranks; P_a keeps 1/Nm of
    it on each and all-gathers it before recomputation, so the checkpoint memory of
    `activation_bytes(..., checkpointing=True)` is divided by Nm. The paper's 100B
    example (Sec 6.1: batch 32, seq 1K, Nm = 16) says about 33 GB per GPU becomes
    about 2 GB; in the book's shape for that model (125 x 8192; the paper's shapes are in
    Table 4, an image) this formula gives 67.1 GB and 4.2 GB at batch 32, and 33.6 GB and
    2.1 GB at batch 16. Sec 3.2 puts the same model at about 60 GB at batch 32, so the
    paper's two figures disagree with each other.
    Raises ValueError for non-positive ints.
    """
    _check_int("nm", nm, 1)
    total = activation_bytes(hidden, batch, seq_len, layers, bytes_per_value, True)
    return _div(total, nm)


def fused_buffer_bytes(psi: float, bytes_per_value: int = 4) -> int | float:
    """Bytes of one flat buffer holding every gradient (Sec 3.2, Sec 6.2).

    Grows with the model: fp32 (4 bytes) for 1.5B parameters is 6 GB (Sec 3.2), for
    3B is 12 GB (Sec 6.2). Raises ValueError if psi < 0 or bytes_per_value < 1.
    """
    _check_real("psi", psi)
    _check_int("bytes_per_value", bytes_per_value, 1)
    return psi * bytes_per_value


def constant_buffer_bytes(psi: float, cap_bytes: int,
                          bytes_per_value: int = 4) -> int | float:
    """Bytes of ZeRO-R's constant-size fused buffer, CB (Sec 6.2).

    The buffer is the fused buffer capped at `cap_bytes`, so it stops growing with
    the model once the model is large. Raises ValueError on negative inputs.
    """
    _check_real("cap_bytes", cap_bytes)
    return min(fused_buffer_bytes(psi, bytes_per_value), cap_bytes)


def comm_collectives_elements(psi: float, stage: int) -> dict[str, int | float]:
    """Elements per device per step of each collective a stage calls (Sec 7).

    Counts the logical tensor of each call as the ledger of comm.py does. Stage 0
    all-reduces the gradients (Sec 7.1); stage 2 reduce-scatters gradients and
    all-gathers updated parameters (Sec 7.2.1).
    Stage 1 calls the same two here; the paper gives it DP's volume (Sec 1, Sec 7)
    and counts no schedule. Stage 3 reduce-scatters gradients and all-gathers
    parameters twice, in forward and backward (Sec 7.2.2).
    Raises ValueError if psi < 0 or stage is not 0-3.
    """
    _check_real("psi", psi)
    _check_stage(stage)
    gathers = {0: 0, 1: 1, 2: 1, 3: 2}[stage]
    return {"all_reduce": psi if stage == 0 else 0,
            "reduce_scatter": 0 if stage == 0 else psi,
            "all_gather": gathers * psi, "broadcast": 0}


def comm_volume_elements(psi: float, stage: int) -> int | float:
    """The paper's communication volume per device per step, in elements (Sec 7).

    2 psi for stages 0-2 and 3 psi for stage 3 (1.5x DP). An all-reduce counts
    twice (reduce-scatter plus all-gather, Sec 7.1). The paper's figures drop the
    ring's (Nd - 1) / Nd factor. Raises ValueError if psi < 0 or stage is not 0-3.
    """
    calls = comm_collectives_elements(psi, stage)
    return (2 * calls["all_reduce"] + calls["reduce_scatter"] + calls["all_gather"]
            + calls["broadcast"])


def mp_allreduce_elements_per_block(seq_len: int, batch: int, hidden: int) -> int:
    """Megatron-style MP all-reduce volume per transformer block and step (Sec 8).

    Six all-reduces of batch x seq_len x hidden values (two in forward, two in the
    recomputed forward, two in backward), each moving twice its message:
    12 x seq_len x hidden x batch elements. Raises ValueError for non-positive ints.
    """
    return 12 * _block_message(seq_len, batch, hidden)


def pa_allgather_elements_per_block(seq_len: int, batch: int, hidden: int) -> int:
    """Extra all-gather volume of P_a per transformer block and step (Sec 8).

    One all-gather of the block's input checkpoint before its recomputation:
    seq_len x hidden x batch elements. Raises ValueError for non-positive ints.
    """
    return _block_message(seq_len, batch, hidden)


def pa_overhead_ratio(seq_len: int, batch: int, hidden: int) -> float:
    """P_a's extra volume as a fraction of MP's (Sec 8): 1/12, under 10%.

    Raises ValueError for non-positive ints.
    """
    return (pa_allgather_elements_per_block(seq_len, batch, hidden)
            / mp_allreduce_elements_per_block(seq_len, batch, hidden))
