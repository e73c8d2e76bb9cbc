"""ZeRO-3's checks: what keeps the model and the ranks to its units.

A unit's parameters hold their values only while it is gathered (:mod:`zerolearn.engines.units`).
Nothing here is needed for the arithmetic; each check names a mistake before it turns
into garbage, a crash or a hang:

* a parameter holds no elements while its unit is freed, and any torch op that reads it
  then raises a ConfigError naming it, its unit and the fix (:class:`ShardedParameter`,
  paid by two class swaps per gather); in debug mode every op of the forward is also
  checked (:class:`ReadGuard`, a ``TorchFunctionMode``), which catches a parameter of a
  user's own ``nn.Parameter`` subclass too;
* ``model.load_state_dict`` outside ``summon_full_params`` and ``torch.compile`` are refused;
* before a backward, the parameters it reaches (:func:`params_reached`, the graph walk of
  DDP's ``find_unused_parameters``) decide which count as zeros (:class:`Reached`); in
  debug mode the ranks also agree that they compute gradients for the same units
  (:func:`agree_backward`, one 8-byte all_gather).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerolearn import comm, guard
from zerolearn.errors import ConfigError

# ----- forward: nothing reads an ungathered parameter -----------------------------------
# Tensor methods and attributes that read no element (shape, dtype, hooks): allowed on
# any parameter, gathered or not (Hugging Face reads self.dtype from a parameter).
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "ndimension", "numel", "nelement", "__len__",
                       "stride", "storage_offset", "element_size", "is_floating_point", "is_complex",
                       "is_contiguous", "get_device", "data_ptr", "untyped_storage", "__hash__",
                       "requires_grad_", "register_hook", "register_post_accumulate_grad_hook"})


class ReadGuard(TorchFunctionMode):
    """During a ZeRO-3 forward, no torch op may read a parameter whose unit is not gathered.

    Args:
        param_unit: ``id(parameter) -> (name, Unit)`` for every sharded parameter.

    Raises:
        ConfigError: (from an op) naming the parameter, its unit, why it is not
            gathered and the fix.
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
    """A ZeRO-3 parameter: outside its unit's gather it holds no elements, only a shard.

    Between gathers a parameter's storage is resized to 0 bytes, and torch would read
    past its end (a segfault) if asked for its values. The engine turns every sharded
    parameter into this subclass of ``nn.Parameter`` (``isinstance(p, nn.Parameter)``
    still holds) while its unit is freed, and back into a plain ``nn.Parameter`` while
    the unit is gathered (``Unit.gathered`` swaps the class), so the guard costs two
    class swaps per gather rather than a Python call per op. A torch op that reads one
    while its unit is not gathered raises a ConfigError naming it and :meth:`Zero3Engine.summon_full_params
    <zerolearn.engines.zero3.Zero3Engine.summon_full_params>`, the context in which every
    parameter holds its full values (as FSDP's ``summon_full_params``). Metadata (shape,
    dtype, ``.grad``, hooks) stays readable; ``repr`` says what the parameter holds.

    Attributes:
        zero3: ``(name, unit)`` of the parameter (set by the engine).
    """

    zero3: tuple

    @classmethod
    def adopt(cls, bucket, unit) -> None:
        """Make ``bucket``'s plain ``nn.Parameter`` objects sharded parameters of ``unit``
        (of this class while ``unit`` is not gathered; a subclass of the user's own keeps
        its class and is not guarded)."""
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
        # Shapes, dtypes, hooks and .grad read no element; p.data hands out the storage itself.
        if name not in _METADATA or (name == "__get__" and _descriptor(func) == "data"):
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


def _descriptor(func) -> str | None:
    """The attribute a property getter or setter belongs to (``data`` for ``p.data``)."""
    return getattr(getattr(func, "__self__", None), "__name__", None)


def refuse_outside(name: str, unit, op: str | None) -> None:
    """Raise the ConfigError for an op that reads parameter ``name`` while ``unit`` is not
    gathered, outside the engine's forward (inside it, :func:`refuse_read` speaks)."""
    raise ConfigError(
        f"ZeRO-3: parameter {name} ({unit.describe()}) was read{f' by {op}' if op else ''} outside the engine's "
        "forward and backward, where this rank holds only its 1/Nd shard of it. To read or change parameters "
        "between steps (log a norm, clamp weights, load a state dict), do it inside "
        "`with engine.summon_full_params():`, which gathers every parameter and writes changes back to the "
        "shards on exit (the same change on every rank); engine.full_state_dict() returns them too. A term "
        "of the loss that reads a weight (an L2 penalty) cannot get its gradient there: compute it inside the "
        "forward of the module that owns the weight, or use the optimizer's weight_decay.")


def refuse_load_outside_summon(module: nn.Module, param_unit: dict[int, tuple]) -> None:
    """``module.load_state_dict`` is about to copy into ``module``'s parameters: refused
    while one of them holds only a shard (outside ``summon_full_params``).

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
    """A load_state_dict pre-hook on every module holding a sharded parameter, refusing a
    load outside ``summon_full_params`` (:func:`refuse_load_outside_summon`); their handles.
    The hooks hold ``param_unit``, not the engine, so the model does not keep it alive."""
    return [m.register_load_state_dict_pre_hook(lambda module, *args: refuse_load_outside_summon(module, param_unit))
            for m in model.modules() if any(id(p) in param_unit for p in m._parameters.values() if p is not None)]


def refuse_compiling() -> None:
    """Inside a unit's gather hook: refuse a forward that torch.compile is tracing."""
    if torch.compiler.is_compiling():
        refuse_compiled(None)


def refuse_compiled(model: nn.Module | None) -> None:
    """Refuse a ``torch.compile``'d model at ZeRO-3 (``model``: at wrap time; None: a
    compiled graph is being traced through a unit's gather hook).

    ZeRO-3 gathers a unit's parameters in hooks around its forward and gives autograd
    gathered weights back through saved-tensor hooks; torch.compile traces the forward
    into graphs that would capture those collectives and the freed (0-byte) storage, so
    the compiled model would not gather what it reads.

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
    """``id`` of every sharded parameter that gets a gradient from ``loss``.

    Walks ``loss``'s autograd graph (as DDP's ``find_unused_parameters`` does): a
    parameter gets a gradient when its accumulation node is reachable. ``loss`` may also
    be a list of autograd nodes (a forward's outputs' ``grad_fn``) to walk from.
    """
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


def _executes(fn) -> bool:
    """Inside a backward: whether it runs node ``fn`` (``backward(inputs=...)`` and
    ``torch.autograd.grad`` leave out the parameters they were not asked for)."""
    try:
        return torch._C._will_engine_execute_node(fn)
    except RuntimeError:  # outside a backward: every node of the graph runs
        return True


class Reached:
    """The parameters of the units (the root's left out), and which of them a backward reaches.

    Args:
        units: the units whose parameters are counted; param_unit: ``id(parameter) -> (name, Unit)``.
    """

    def __init__(self, units: list, param_unit: dict[int, tuple]):
        self.slots = [(b, i, unit.index) for unit in units for b in unit.buckets for i in range(len(b.params))]
        self.slot_of = {id(b.params[i]): k for k, (b, i, _) in enumerate(self.slots)}
        self.param_unit = param_unit

    def count(self, roots: list, units: list, pg, device, check: bool = False) -> int:
        """Count each parameter of a unit this backward reaches that gets no gradient here as
        arrived in its bucket (``ready``; its gradient is zeros), so the bucket completes in
        its unit's backward on every rank, whichever ranks compute that parameter. Returns
        how many were counted. ``check`` (debug mode): first agree with the other ranks that
        every rank reaches the same units (:func:`agree_backward`).

        Raises:
            ConfigError: from :func:`agree_backward`.
        """
        mine = {self.slot_of[i] for i in params_reached(roots, self.param_unit) if i in self.slot_of}
        reached_units = sorted({self.slots[k][2] for k in mine})
        if check:
            agree_backward(reached_units, units, pg, device)
        counted = 0
        for k, (b, _, u) in enumerate(self.slots):
            if k not in mine and u in reached_units:
                b.ready += 1
                counted += 1
        return counted


def agree_backward(reached: list[int], units: list, pg, device) -> None:
    """Debug mode: check, before backward, that every rank computes gradients for the same
    units. A unit may call some of its sub-modules on some ranks only (an expert no token
    reached here): that is allowed, its parameters count as zeros (:meth:`Reached.count`);
    a unit whose gradients only some ranks compute would make the ranks gather different
    units in backward. One 8-byte all_gather of a checksum; the lists are exchanged only
    when they differ.

    Args:
        reached: indices of the units (the root left out) with a parameter that gets a
            gradient on this rank.

    Raises:
        ConfigError: some units get gradients on some ranks only, each named with its ranks.
    """
    code = zlib.crc32(f"{reached}".encode())
    if len(set(guard.propose(code, pg, device).result())) == 1:
        return
    everyone = comm.gather_objects(reached, group=pg)
    if any(set(u) != set(everyone[0]) for u in everyone):
        _refuse_backward(everyone, units, pg)


def _refuse_backward(everyone: list[list[int]], units: list, pg) -> None:
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
    """Raise the ConfigError for a unit whose forward returns, inside a ``type(output)``
    other than a tensor, list or tuple, a view of its own parameters (freed once it returns)."""
    raise ConfigError(
        f"ZeRO-3: {unit.describe()} returned a view of its own parameter inside a {type(output).__name__}; "
        "its parameters are freed when its forward returns, so the view would hold nothing. Return a copy "
        "(self.weight[:n].clone()) or a tensor, list or tuple of outputs (the engine copies a view there)")
