"""One engine per ZeRO-DP stage, one interface (docs/ARCHITECTURE.md, "The engines").

Stage numbers follow DeepSpeed: 0 = DP baseline, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p.
"""

from zerolearn.dist import ConfigError
from zerolearn.engines.base import Bucket, Engine
from zerolearn.engines.ddp import DDPEngine
from zerolearn.engines.optim import OPTIMIZERS
from zerolearn.engines.zero1 import Zero1Engine
from zerolearn.engines.zero2 import Zero2Engine
from zerolearn.engines.zero3 import Zero3Engine
from zerolearn.memory.model import STAGE_NAMES  # the paper's names; stage_title() gives "ZeRO-1 (P_os)"

ENGINES: dict[int, type[Engine]] = {0: DDPEngine, 1: Zero1Engine, 2: Zero2Engine, 3: Zero3Engine}


def make_engine(stage: int, model, **kwargs) -> Engine:
    """The engine for ``stage`` (0-3) around ``model``; kwargs as :class:`Engine`.

    Raises:
        ConfigError: ``stage`` not in 0-3, or any error of :class:`Engine`.
    """
    if stage not in ENGINES:
        raise ConfigError(f"--stage {stage!r}: allowed are 0, 1, 2, 3")
    return ENGINES[stage](model, **kwargs)


__all__ = ["ENGINES", "OPTIMIZERS", "STAGE_NAMES", "Bucket", "DDPEngine", "Engine", "Zero1Engine",
           "Zero2Engine", "Zero3Engine", "make_engine"]
