"""ZeRO-3's checks: each names a misuse of the units before it turns into garbage, a crash or a hang."""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerolearn import comm, guard
from zerolearn.errors import ConfigError

# Tensor methods and attributes that read no element: allowed on any parameter (Hugging Face reads self.dtype).
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "ndimension", "numel", "nelement", "__len__",
                       "stride", "storage_offset", "element_size", "is_floating_point", "is_complex",
                       "is_contiguous", "get_device", "data_ptr", "untyped_storage", "__hash__",
                       "requires_grad_", "register_hook", "register_post_accumulate_grad_hook"})


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
            for p in _parameters_in(args, kwargs):
                found = self.param_unit.get(id(p))
                if found is not None and not found[1].gathered:
                    refuse_read(*found)
        return func(*args, **kwargs)


def _parameters_in(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, nn.Parameter):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, nn.Parameter))


def refuse_read(name: str, unit) -> None:
    """Raise the ConfigError for a read of parameter ``name`` while ``unit`` is not gathered."""
    if unit.ran:
        when = "after that unit's forward had returned and freed it"
    elif unit.gathering:
        when = "before that unit's forward ran (its all_gather was only prefetched, still in flight)"
    else:
        when = "while that unit was not gathered (its forward had not run in this forward pass)"
    raise ConfigError(
        f"ZeRO-3: the model read parameter {name} ({unit.describe()}) outside that unit's forward, {when}; "
        "a unit's parameters hold their values only inside its own forward (for example "
        "F.linear(h, self.emb.weight) or self.child.bias in the parent's forward reads them outside). "
        "Tie through modules instead (lm_head.weight = emb.weight: shared parameters stay gathered in the "
        f"root unit), or pass units= so that the module that reads the parameter and {unit.name} are in one "
        f"unit (a module left out of units= belongs to the root unit, gathered for the whole forward).")


class ShardedParameter(nn.Parameter):
    """A ZeRO-3 parameter while its unit is freed (0 bytes of storage, which torch would read past: a
    segfault); a plain ``nn.Parameter`` while gathered (``Unit.gathered`` swaps the class). Metadata and
    ``repr`` stay readable; ``zero3``: ``(name, unit)``, set by the engine.

    Raises:
        ConfigError: a torch op reads it while its unit is not gathered (:func:`refuse_read`, :func:`refuse_outside`).
    """

    zero3: tuple

    @classmethod
    def adopt(cls, bucket, unit) -> None:
        """Make ``bucket``'s plain ``nn.Parameter`` objects sharded parameters of ``unit`` (a subclass: left alone)."""
        for name, p in zip(bucket.layout.names, bucket.params, strict=True):
            if type(p) is nn.Parameter:
                p.zero3 = (name, unit)
                unit.sharded.append(p)
                if not unit.gathered:
                    p.__class__ = cls

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        data = name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data"
        if name not in _METADATA or data:  # p.data hands out the storage itself
            for p in _parameters_in(args, kwargs):
                found = getattr(p, "zero3", None)
                if found is not None and not found[1].gathered:
                    if name == "__repr__":
                        return (f"ZeRO-3 parameter {found[0]} of shape {tuple(p.shape)}: not gathered, this "
                                "rank holds a shard (engine.summon_full_params() gathers it)")
                    if found[1].in_forward:
                        refuse_read(*found)
                    refuse_outside(*found, name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def refuse_outside(name: str, unit, op: str | None) -> None:
    """Raise the ConfigError for op ``op`` reading parameter ``name`` of a freed ``unit`` outside a forward."""
    raise ConfigError(
        f"ZeRO-3: parameter {name} ({unit.describe()}) was read{f' by {op}' if op else ''} outside the engine's "
        "forward and backward, where this rank holds only its 1/Nd shard of it. To read or change parameters "
        "between steps (log a norm, clamp weights, load a state dict), do it inside "
        "`with engine.summon_full_params():`, which gathers every parameter and writes changes back to the "
        "shards on exit (the same change on every rank); engine.full_state_dict() returns them too. A term "
        "of the loss that reads a weight (an L2 penalty) cannot get its gradient there: compute it inside the "
        "forward of the module that owns the weight, or use the optimizer's weight_decay.")


def refuse_load_outside_summon(module: nn.Module, param_unit: dict[int, tuple]) -> None:
    """Refuse ``module.load_state_dict`` while a parameter of ``module`` holds only a shard.

    Raises:
        ConfigError: naming the parameter and ``engine.load_state_dict``.
    """
    for p in module._parameters.values():
        found = param_unit.get(id(p)) if p is not None else None
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
            for m in model.modules() if any(id(p) in param_unit for p in m._parameters.values() if p is not None)]


def refuse_compiling() -> None:
    """Inside a unit's gather hook: refuse a forward that torch.compile is tracing."""
    if torch.compiler.is_compiling():
        refuse_compiled(None)


def refuse_compiled(model: nn.Module | None) -> None:
    """Refuse a ``torch.compile``'d ``model`` (None: one being traced), whose graphs skip the gathers in hooks.

    Raises:
        ConfigError: the model, or one of its modules, is compiled (or being compiled).
    """
    if model is not None:
        compiled = [name or "<model>" for name, m in model.named_modules()
                    if getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")]
        if not compiled:
            return
        what = f"{', '.join(compiled[:4])} {'is' if len(compiled) == 1 else 'are'} compiled"
    else:
        what = "the model's forward is being compiled (torch.compile)"
    raise ConfigError(
        f"ZeRO-3: {what}. Stage 3 gathers each unit's parameters in hooks around its forward and frees them "
        "after it, which a compiled graph does not run as eager code does, so its parameters would hold no "
        "values; train the compiled model at stages 0-2 (exact, as torch DDP), or the uncompiled model at stage 3")


def params_reached(loss, param_unit: dict[int, tuple]) -> set[int]:
    """``id`` of each sharded parameter ``loss``'s graph (or nodes) reaches, as DDP's ``find_unused_parameters``."""
    seen, stack, reached = set(), list(loss) if isinstance(loss, list) else [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf tensor
        if variable is not None and id(variable) in param_unit and _executes(fn):
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


def _executes(fn) -> bool:  # whether the running backward runs node fn (backward(inputs=...) may not)
    try:
        return torch._C._will_engine_execute_node(fn)
    except RuntimeError:  # outside a backward: every node of the graph runs
        return True


class Reached:
    """The parameters of ``units`` (the root's left out) and which a backward reaches (``param_unit``: ReadGuard's)."""

    def __init__(self, units: list, param_unit: dict[int, tuple]):
        self.slots = [(b, i, unit.index) for unit in units for b in unit.buckets for i in range(len(b.params))]
        self.slot_of = {id(b.params[i]): k for k, (b, i, _) in enumerate(self.slots)}
        self.param_unit = param_unit

    def count(self, roots: list, units: list, pg, device, check: bool = False) -> int:
        """Count as arrived (``ready``, gradient zeros) each parameter of a reached unit that gets no gradient
        here, so its bucket completes in its unit's backward on every rank; returns how many (``check``: debug).

        Raises:
            ConfigError: from :func:`agree_backward`.
        """
        mine = {self.slot_of[i] for i in params_reached(roots, self.param_unit) if i in self.slot_of}
        reached_units = sorted({self.slots[k][2] for k in mine})
        if check:
            agree_backward(reached_units, units, pg, device)
        missing = [b for k, (b, _, u) in enumerate(self.slots) if k not in mine and u in reached_units]
        for b in missing:
            b.ready += 1
        return len(missing)


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


def refuse_view_output(unit, output) -> None:
    """Raise the ConfigError for a view of ``unit``'s parameters returned inside a ``type(output)``."""
    raise ConfigError(
        f"ZeRO-3: {unit.describe()} returned a view of its own parameter inside a {type(output).__name__}; "
        "its parameters are freed when its forward returns, so the view would hold nothing. Return a copy "
        "(self.weight[:n].clone()) or a tensor, list or tuple of outputs (the engine copies a view there)")
