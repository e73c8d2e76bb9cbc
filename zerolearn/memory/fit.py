"""Does a model fit? The smallest ZeRO stage and GPU count for a device (Sec 5, Table 1).

Built on the paper's formulas in :mod:`zerolearn.memory.model`; nothing here
re-derives them. Memory is in bytes; the paper's GB is decimal (``model.GB``).

The question a reader brings: "I have GPUs with M bytes each and a model of Psi
parameters; which stage do I need and how many GPUs?" Per-device model states
fall as Nd grows for every stage except DP (Fig 1), so the answer is the smallest
Nd at which some stage fits. Activations (Sec 3.2) do not shrink with Nd, which is
why a batch size can change the answer.

Bad input raises :class:`zerolearn.dist.ConfigError` (a ValueError) before any
arithmetic, with a message naming the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from zerolearn.errors import ConfigError
from zerolearn.memory.model import STAGE_NAMES, activation_bytes, dtype_bytes, model_state_bytes, optimizer_k

__all__ = ["ActivationSpec", "Fit", "gpt_params", "per_device_bytes", "smallest_fit", "table"]

DEFAULT_MAX_ND = 1024
"""Largest Nd :func:`smallest_fit` tries by default (the paper's Table 1 stops at 1024)."""


@dataclass(frozen=True)
class ActivationSpec:
    """Shape of the activations one device keeps for backward (Sec 3.2).

    ``hidden`` and ``layers`` describe a GPT-like transformer; ``batch_per_gpu``
    sequences of ``seq_len`` tokens per device and step. With ``checkpointing`` only
    each block's input is kept (Sec 6.1). Values take the working dtype's width.
    Under model parallelism the checkpoints are replicated on every MP rank (Sec 6.1,
    P_a not applied), so they are not divided by Nm.

    With a spec, the other residual states of Sec 3.2 are counted too: the working set
    of recomputing one block in backward (with checkpointing), and the temporary
    buffer that fuses all gradients into one fp32 buffer for the all-reduce or the
    gradient norm, 4 Psi / Nm bytes (Sec 3.2: 6 GB for 1.5B parameters), unless
    ``constant_buffer_bytes`` gives ZeRO-R's constant-size buffer instead (CB, Sec
    6.2). Fragmentation (Sec 3.2, 6.3) has no size to add: the paper reports OOM with
    over 30% of memory free in extreme cases; headroom is what guards against it.
    """

    hidden: int
    layers: int
    batch_per_gpu: int
    seq_len: int
    checkpointing: bool = False
    constant_buffer_bytes: int | None = None


@dataclass(frozen=True)
class Fit:
    """One answer of :func:`smallest_fit`: ``stage`` at data-parallel degree ``nd``.

    ``bytes_per_device`` is the memory one device needs (model states plus any
    activations), ``headroom_bytes`` what is left of ``device_bytes``. The job uses
    ``gpus = nd * nm`` devices.
    """

    stage: int
    nd: int
    nm: int
    bytes_per_device: int | float
    device_bytes: int | float
    headroom_bytes: int | float

    @property
    def gpus(self) -> int:
        return self.nd * self.nm

    @property
    def utilization(self) -> float:
        """Fraction of the device the job uses, 0-1."""
        return self.bytes_per_device / self.device_bytes

    @property
    def stage_name(self) -> str:
        return STAGE_NAMES[self.stage]


def _fail(message: str) -> NoReturn:
    raise ConfigError(message)


def _check_count(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(f"{name} {value!r}: must be an integer >= {minimum}")


def _check_size(name: str, value: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    # `not value > 0` also catches NaN; infinity would make every answer meaningless.
    if not ok or not value > 0 or not math.isfinite(value):
        _fail(f"{name} {value!r}: must be a finite number > 0")


def _k_and_width(optimizer: str, dtype: str, momentum: bool) -> tuple[int, int]:
    """K (Sec 3.1) and the working dtype's bytes, model.py's errors as ConfigError."""
    if not isinstance(momentum, bool):
        _fail(f"momentum {momentum!r}: must be True or False")
    try:
        return optimizer_k(optimizer, dtype, momentum), dtype_bytes(dtype)
    except ValueError as e:  # model.py names the value and the allowed ones
        raise ConfigError(str(e)) from None


def _check_activation(activation: ActivationSpec | None) -> None:
    if activation is None:
        return
    if not isinstance(activation, ActivationSpec):
        _fail(f"activation {activation!r}: must be an ActivationSpec or None")
    for name in ("hidden", "layers", "batch_per_gpu", "seq_len"):
        _check_count(f"activation.{name}", getattr(activation, name))
    if activation.constant_buffer_bytes is not None:
        _check_count("activation.constant_buffer_bytes", activation.constant_buffer_bytes)


def _check_common(psi: float, nm: int, activation: ActivationSpec | None,
                  optimizer: str, dtype: str, momentum: bool) -> tuple[int, int]:
    _check_size("psi", psi)
    _check_count("nm", nm)
    _check_activation(activation)
    return _k_and_width(optimizer, dtype, momentum)


def _per_device(psi: float, nd: int, stage: int, k: int, width: int, nm: int,
                activation: ActivationSpec | None) -> dict[str, int | float]:
    """Unchecked core of :func:`per_device_bytes`; inputs already validated."""
    # Mixed precision (Sec 3.1): params and grads in the working dtype, K covers the rest.
    states = model_state_bytes(psi, nd, stage, k=k, param_bytes=width, grad_bytes=width, nm=nm)
    act = recompute = buffers = 0
    if activation is not None:
        a = activation
        act = activation_bytes(a.hidden, a.batch_per_gpu, a.seq_len, a.layers, bytes_per_value=width,
                               checkpointing=a.checkpointing)
        if a.checkpointing:  # backward recomputes one block with all its activations (Sec 3.2)
            recompute = activation_bytes(a.hidden, a.batch_per_gpu, a.seq_len, 1, bytes_per_value=width)
        # One fused fp32 buffer for every gradient (Sec 3.2), or ZeRO-R's CB (Sec 6.2).
        buffers = 4 * psi / nm if a.constant_buffer_bytes is None else a.constant_buffer_bytes
        buffers = int(buffers) if float(buffers).is_integer() else buffers
    return {"params": states["params"], "grads": states["grads"],
            "optimizer_states": states["optimizer_states"], "activations": act,
            "recompute": recompute, "temporary_buffers": buffers,
            "total": states["total"] + act + recompute + buffers}


def per_device_bytes(psi: float, nd: int, stage: int, *, optimizer: str = "adam", dtype: str = "bf16",
                     momentum: bool = True, nm: int = 1,
                     activation: ActivationSpec | None = None) -> dict[str, int | float]:
    """Bytes one device holds at ZeRO ``stage`` with data-parallel degree ``nd``.

    Model states from ``model.model_state_bytes`` (Sec 3.1, Sec 5, Fig 1) with K
    from ``model.optimizer_k`` and parameter/gradient widths from
    ``model.dtype_bytes``; activations from ``model.activation_bytes`` (Sec 3.2) when
    ``activation`` is given, and then the recomputation's working set and the
    temporary buffers (Sec 3.2, 6.2; see :class:`ActivationSpec`), else 0.
    Fragmentation (Sec 3.2, 6.3) is not a size and is not counted.

    Args: psi parameters (> 0); nd, nm ints >= 1; stage 0-3; optimizer "adam",
    "adamw" or "sgd"; dtype "fp32", "bf16" or "fp16"; momentum (SGD only).
    Returns {"params", "grads", "optimizer_states", "activations", "recompute",
    "temporary_buffers", "total"} in bytes.
    Raises ConfigError for any bad input.
    """
    k, width = _check_common(psi, nm, activation, optimizer, dtype, momentum)
    _check_count("nd", nd)
    if isinstance(stage, bool) or stage not in STAGE_NAMES:
        _fail(f"stage {stage!r}: must be one of 0, 1, 2, 3 ({STAGE_NAMES})")
    return _per_device(psi, nd, stage, k, width, nm, activation)


def _fewest_nd(fits, max_nd: int) -> int | None:
    """Smallest nd in 1..max_nd with fits(nd) true, or None.

    Binary search is valid because per-device bytes never grow with Nd: each term
    of every stage is either constant or divided by Nd (Sec 5).
    """
    if not fits(max_nd):
        return None
    lo, hi = 1, max_nd  # invariant: fits(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def smallest_fit(psi: float, device_bytes: float, *, optimizer: str = "adam", dtype: str = "bf16",
                 momentum: bool = True, nm: int = 1, activation: ActivationSpec | None = None,
                 max_nd: int = DEFAULT_MAX_ND) -> Fit | None:
    """The fewest GPUs, then the lowest stage, at which ``psi`` fits in ``device_bytes``.

    The rule: among all (stage, Nd) with per-device bytes <= ``device_bytes`` and
    Nd <= ``max_nd``, take the smallest Nd; among the stages that fit at that Nd,
    the lowest (lower stages communicate no more, Sec 7, and partition less).
    Example (model states only, bf16 Adam, K = 12): 7e9 parameters on 80e9-byte
    GPUs need stage 1 at Nd = 2: 4 x 7e9 + 12 x 7e9 / 2 = 70e9 bytes per device.

    Args as :func:`per_device_bytes`; device_bytes > 0; max_nd int >= 1.
    Returns a :class:`Fit`, or None when no stage fits at any Nd <= max_nd.
    Raises ConfigError for bad input.
    """
    k, width = _check_common(psi, nm, activation, optimizer, dtype, momentum)
    _check_size("device_bytes", device_bytes)
    _check_count("max_nd", max_nd)

    def total(nd: int, stage: int) -> int | float:
        return _per_device(psi, nd, stage, k, width, nm, activation)["total"]

    best: tuple[int, int] | None = None
    for stage in STAGE_NAMES:
        nd = _fewest_nd(lambda n, s=stage: total(n, s) <= device_bytes, max_nd)
        # Tuples compare Nd first, then stage: exactly the documented rule.
        if nd is not None and (best is None or (nd, stage) < best):
            best = (nd, stage)
    if best is None:
        return None
    nd, stage = best
    need = total(nd, stage)
    return Fit(stage=stage, nd=nd, nm=nm, bytes_per_device=need, device_bytes=device_bytes,
               headroom_bytes=device_bytes - need)


def table(psi: float, nds: list[int], *, optimizer: str = "adam", dtype: str = "bf16",
          momentum: bool = True, nm: int = 1,
          activation: ActivationSpec | None = None) -> list[dict]:
    """Per-device bytes of every stage for each Nd in ``nds`` (Table 1's layout).

    Returns one row per Nd, in the given order: ``{"nd": nd, "stages": [b0, b1, b2,
    b3]}`` where ``b<stage>`` is the :func:`per_device_bytes` dict (bytes) of that
    stage. Raises ConfigError for bad input, including an empty ``nds``.
    """
    k, width = _check_common(psi, nm, activation, optimizer, dtype, momentum)
    if len(nds) == 0:
        _fail("nds []: give at least one Nd")
    for nd in nds:
        _check_count("nd", nd)
    return [{"nd": nd, "stages": [_per_device(psi, nd, s, k, width, nm, activation) for s in STAGE_NAMES]}
            for nd in nds]


def gpt_params(layers: int, hidden: int, vocab: int = 50257, seq_len: int = 1024, *,
               tied_embeddings: bool = True) -> int:
    """Parameters of a GPT-2-style transformer (the paper's models, Sec 10.1, Tables 4-10).

    The paper sizes its models by layers and hidden size only; this is the standard
    count, not the paper's. Per block: attention 4 h^2 + 4 h (fused qkv and output
    projection with biases), MLP 8 h^2 + 5 h (h -> 4h -> h), two LayerNorms 4 h;
    that is 12 h^2 + 13 h, the familiar ``12 * layers * hidden**2`` plus small terms.
    Plus token and position embeddings (vocab + seq_len) h and a final LayerNorm
    2 h. GPT-2 ties the output projection to the token embedding; untied adds
    vocab x h. 48 x 1600 (the paper's 1.5B) gives 1,557,611,200, GPT-2 XL's count.

    All arguments ints >= 1. Raises ConfigError otherwise.
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("vocab", vocab), ("seq_len", seq_len)):
        _check_count(name, value)
    blocks = layers * (12 * hidden**2 + 13 * hidden)
    embeddings = (vocab + seq_len) * hidden
    head = 0 if tied_embeddings else vocab * hidden
    return blocks + embeddings + 2 * hidden + head
