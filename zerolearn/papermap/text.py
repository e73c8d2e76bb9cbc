"""How the paper map prints numbers.

Units: the paper's decimal GB (1e9 bytes, ``model.GB``), parameters in billions (B),
communication in elements. Printed: GB to 1 decimal, ratios to 3 significant digits.
"""

from __future__ import annotations

from zerolearn.memory.model import GB, STAGE_NAMES, model_state_bytes


def _gb(nbytes: float) -> str:
    """Bytes as the paper's decimal GB: 1 decimal, 3 significant digits below 1 GB."""
    gb = nbytes / GB
    return f"{gb:.1f} GB" if gb >= 1 else f"{gb:.3g} GB"


def _sig(x: float) -> str:
    """A ratio to 3 significant digits."""
    return f"{x:.3g}"


def _b(psi: float) -> str:
    """Parameters in billions, 1 decimal."""
    return f"{psi / 1e9:.1f}B"


def _tex(stage: int) -> str:
    """A stage's name as the page writes it: DP, $P_{os}$, $P_{os+g}$, $P_{os+g+p}$."""
    name = STAGE_NAMES[stage]
    return name if stage == 0 else f"$P_{{{name[2:]}}}$"


def _states(psi: float, nd: int, stage: int, nm: int = 1) -> float:
    """Model-state bytes per device (Sec 5, ``model.model_state_bytes``, K = 12)."""
    return model_state_bytes(psi, nd, stage, nm=nm)["total"]


def _fit_text(fit) -> str:
    """A ``Fit`` in words: stage name, GPUs, GB per GPU."""
    if fit is None:
        return "nothing fits up to Nd = 1024"
    return f"{_tex(fit.stage)} on {fit.gpus} GPUs, {_gb(fit.bytes_per_device)} each"
