"""Mixed precision as in the paper (Sec 3.1): 2-byte working copies, fp32 master.

Forward and backward run in the working dtype (fp32, bf16 or fp16). For the 2-byte
dtypes the optimizer updates an fp32 master copy of the parameters, which is then
cast back into the working copy; for fp32 the working copy *is* the master, so no
second copy exists. That is why K (optimizer-state bytes per parameter) is 12 for
mixed-precision Adam (master 4 + moments 4 + 4) and 8 for fp32 Adam.

fp16 has too little exponent range for small gradients, so its loss is multiplied
by a dynamic scale; a step whose gradients overflow is skipped on every rank alike
and the scale halves, and after ``growth_interval`` clean steps it doubles again.
torch's ``GradScaler`` does this per optimizer on local gradients only; here the
overflow flag must be agreed across ranks holding different shards, so the engine
feeds :class:`LossScaler` a flag it has already reduced (a device tensor: the scale is
updated on the device, and a skipped step is masked there, never read by the host).
"""

from __future__ import annotations

import torch

from zerolearn.dist import ConfigError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` -> torch dtype; ConfigError names anything else."""
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: allowed are {', '.join(DTYPES)}")
    return DTYPES[name]


def check_param_dtypes(model, dtype: torch.dtype) -> None:
    """Refuse a model whose trainable floating parameters the engine would have to cast silently.

    An engine takes trainable parameters in fp32 and runs them in ``dtype`` (one working
    precision, one fp32 master). A trainable parameter in any other floating dtype
    (float64, or bf16 in an fp32 run) would lose or change precision without a word, so
    it is refused. Frozen parameters (``requires_grad=False``) are not stepped and keep
    their dtype (a frozen bf16 base beside fp32 adapters), as buffers do; fp32 ones run in
    ``dtype`` with the rest of the model.

    Raises:
        ConfigError: naming the parameters (up to 4 per dtype) and their dtypes.
    """
    allowed = {torch.float32, dtype}
    odd: dict[torch.dtype, list[str]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype not in allowed:
            odd.setdefault(p.dtype, []).append(name)
    if odd:
        found = "; ".join(f"{str(d).removeprefix('torch.')}: {', '.join(names[:4])}"
                          + (f" and {len(names) - 4} more" if len(names) > 4 else "") for d, names in odd.items())
        shown = ", ".join(str(d).removeprefix("torch.") for d in sorted(allowed, key=str))
        raise ConfigError(f"trainable parameters in a dtype the engine would cast silently ({found}); an engine "
                          f"takes {shown} trainable parameters and trains in one working dtype (--dtype) with an "
                          "fp32 master: convert them first (model.float()), freeze them (requires_grad_(False) "
                          "keeps their dtype), or train the model without the engine")


def needs_master(dtype: torch.dtype) -> bool:
    """True for 2-byte working dtypes, which keep an fp32 master copy (Sec 3.1)."""
    return dtype != torch.float32


class LossScaler:
    """Dynamic loss scale for fp16; a constant 1.0 (disabled) for fp32 and bf16.

    The scale, the count of clean steps since the last overflow and the count of skipped
    steps live in 0-dim tensors on the engine's device, as torch's ``GradScaler`` keeps
    its scale: :meth:`update` takes the overflow flag as a device tensor and decides on
    the device (``torch.where``), so a step never waits for the host to read the flag.
    :attr:`scale`, :attr:`clean_steps` and :attr:`skipped_steps` read them (a host read:
    call them outside the step, as a training loop reads its loss).

    Args:
        enabled: scale at all (True for fp16).
        init_scale: starting scale (2**16, as torch's GradScaler).
        growth_interval: clean steps after which the scale doubles.
        device: where the scale lives (the engine's device; default the CPU).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000,
                 device: torch.device | str | None = None):
        self.enabled = enabled
        self.growth_interval = growth_interval
        device = torch.device("cpu") if device is None else torch.device(device)
        # float64: the same number a Python float holds (1/scale and the norm are computed in it)
        self._scale = torch.tensor(init_scale if enabled else 1.0, dtype=torch.float64, device=device)
        self._clean = torch.zeros((), dtype=torch.int64, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale, a float64 0-dim tensor on the device (no host read)."""
        return self._scale

    @property
    def scale(self) -> float:
        """The scale now (a host read of :attr:`scale_tensor`)."""
        return float(self._scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale.fill_(float(value))

    @property
    def clean_steps(self) -> int:
        """Steps since the last overflow (a host read)."""
        return int(self._clean)

    @clean_steps.setter
    def clean_steps(self, value: int) -> None:
        self._clean.fill_(int(value))

    @property
    def skipped_steps(self) -> int:
        """Steps an overflow skipped, in all (a host read)."""
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped.fill_(int(value))

    def update(self, found_inf: torch.Tensor | bool) -> None:
        """Record one step; ``found_inf`` (a bool 0-dim tensor, or a bool) must be the same
        on every rank. Overflow: the scale halves (not below 1.0), the clean count restarts,
        the skipped count grows; else the clean count grows and the scale doubles at each
        multiple of ``growth_interval``. Decided on the device: nothing is read."""
        if not self.enabled:
            return
        inf = torch.as_tensor(found_inf, device=self._scale.device)
        clean = torch.where(inf, torch.zeros_like(self._clean), self._clean + 1)
        grow = (clean % self.growth_interval == 0) & ~inf
        halved = torch.clamp(self._scale / 2.0, min=1.0)
        self._scale.copy_(torch.where(inf, halved, torch.where(grow, self._scale * 2.0, self._scale)))
        self._clean.copy_(clean)
        self._skipped.add_(inf.to(self._skipped.dtype))

    def state_dict(self) -> dict:
        """``{"scale": float, "clean_steps": int, "skipped_steps": int}`` (host reads)."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.skipped_steps = state["skipped_steps"]
