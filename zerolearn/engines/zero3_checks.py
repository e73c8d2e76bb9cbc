"""ZeRO-3's checks in debug mode (the ranks agree on the units a backward reaches; no op reads an ungathered
parameter) and load_state_dict outside a summon refused: each names a misuse before it turns into garbage or a hang."""

from __future__ import annotations

import zlib

from torch import nn
from torch.overrides import TorchFunctionMode

from zerolearn import comm, guard
from zerolearn.engines.units import _METADATA, _ungathered, refuse_read
from zerolearn.errors import ConfigError


class ReadGuard(TorchFunctionMode):
    """In a debug-mode forward, no op may read a parameter of an ungathered unit; ``param_unit``: id -> (name, Unit).

    Raises:
        ConfigError: (from an op) naming the parameter, its unit, why it is not gathered and the fix.
    """

    def __init__(self, param_unit: dict[int, tuple]):
        super().__init__()
        self.param_unit = param_unit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in _METADATA:
            for _, found in _ungathered(args, kwargs, lambda p: self.param_unit.get(id(p))):
                refuse_read(*found)
        return func(*args, **kwargs)


def refuse_load_outside_summon(module: nn.Module, param_unit: dict[int, tuple]) -> None:
    """Refuse ``module.load_state_dict`` while a parameter of ``module`` holds only a shard.

    Raises:
        ConfigError: naming the parameter and ``engine.load_state_dict``.
    """
    for p in module.parameters(recurse=False):
        found = param_unit.get(id(p))
        if found is not None and not found[1].gathered:
            raise ConfigError(
                f"ZeRO-3: parameter {found[0]} ({found[1].describe()}) holds only this rank's 1/Nd shard, so "
                "load_state_dict into the wrapped model cannot copy into it: call engine.load_state_dict(state_dict) "
                "instead (on every rank, with the same full state dict), or model.load_state_dict inside "
                "`with engine.summon_full_params():`; both gather the parameters, load, and write the values "
                "back to the shards and the fp32 masters")


def guard_load_state_dict(model: nn.Module, param_unit: dict[int, tuple]) -> list:
    """Handles of load_state_dict pre-hooks (:func:`refuse_load_outside_summon`) that hold no engine."""
    return [m.register_load_state_dict_pre_hook(lambda module, *args: refuse_load_outside_summon(module, param_unit))
            for m in model.modules() if any(id(p) in param_unit for p in m.parameters(recurse=False))]


def agree_backward(reached: list[int], units: list, pg, device) -> None:
    """Debug mode, before backward: check with one 8-byte all_gather of a checksum that every rank computes
    gradients for the same units (``reached``: indices of those, the root left out, with a gradient here).

    Raises:
        ConfigError: some units get gradients on some ranks only, each named with its ranks.
    """
    code = zlib.crc32(f"{reached}".encode())
    if len(set(guard.propose(code, pg, device).result())) == 1:
        return
    everyone = comm.gather_objects(reached, group=pg)
    if all(set(u) == set(everyone[0]) for u in everyone):
        return
    ranks = guard.group_ranks(pg)
    by_index = {u.index: u for u in units}
    differ = sorted(set().union(*map(set, everyone)) - set.intersection(*map(set, everyone)))
    doing = "; ".join(f"{by_index[i].describe()} on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))} "
                      "only" for i in differ
                      for on in [[r for r, got in zip(ranks, everyone, strict=True) if i in got]])
    raise ConfigError(
        f"ZeRO-3: ranks are about to compute gradients for different units ({doing}): some parameters "
        "get gradients on some ranks only (a unit whose output only some ranks use, or a branch that "
        "depends on the rank or its data), so the ranks would gather different units in backward. Leave "
        "such a module out of units= (its parameters then belong to the root unit, gathered for the whole "
        "backward and reduced at its end on every rank).")


