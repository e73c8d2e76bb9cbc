"""The package's error for bad input and the checks that raise it, importable without torch.

Every option of every entry point (``TrainConfig``, the engines, ``python -m
zerolearn.memory``, the cost model) is checked with these three functions, so a bad
value always reads the same way: ``--steps 0: must be an integer >= 1``,
``--lr nan: must be a finite number > 0``, ``--dtype 'int8': allowed are fp32, bf16, fp16``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad input, detected before any work starts (the CLIs exit with code 2)."""


def _shown(value) -> str:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


def require_count(name: str, value, minimum: int = 1) -> None:
    """Raise ConfigError unless ``value`` is an integer >= ``minimum`` (``name`` as the caller spells it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} {_shown(value)}: must be an integer >= {minimum}")


def require_real(name: str, value, *, minimum: float = 0.0, strict: bool = True, allow_inf: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a number > ``minimum`` (>= if not ``strict``), finite
    unless ``allow_inf``. NaN is refused (it compares false with everything)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    above = number and (value > minimum if strict else value >= minimum)
    if not above or (math.isinf(value) and not allow_inf):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        kind = f"a number {bound} (inf allowed)" if allow_inf else f"a finite number {bound}"
        raise ConfigError(f"{name} {_shown(value)}: must be {kind}")


def require_choice(name: str, value, allowed: Iterable) -> None:
    """Raise ConfigError unless ``value`` is one of ``allowed``, listing them."""
    allowed = tuple(allowed)
    if isinstance(value, bool) or value not in allowed:
        raise ConfigError(f"{name} {_shown(value)}: allowed are {', '.join(str(a) for a in allowed)}")
