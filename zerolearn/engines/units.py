"""ZeRO-3's units, and the guards that keep the model and the ranks to them.

A unit is a module whose buckets ZeRO-3 gathers and frees together (paper Sec 5.3);
:mod:`zerolearn.engines.zero3` says when. This file says which parameters belong to
which unit (:func:`assign`) and checks, as FSDP2 does by looking at its parameters'
state, that nothing goes wrong silently around them:

* the model may read a unit's parameters only while the unit is gathered
  (:class:`ReadGuard`, a ``TorchFunctionMode`` run during forward; a read elsewhere
  is a ConfigError naming the parameter, its unit and the fix, before any arithmetic);
* every rank runs the same units and computes gradients for the same units, so a branch
  taken on some ranks only is named at once instead of pairing gathers of different
  sizes: one 8-byte all_gather before each unit's forward (:func:`agree_forward`) and
  one before backward (:func:`agree_backward`), outside the ledger.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerolearn import comm, guard
from zerolearn.errors import ConfigError

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # modules with no forward: their hooks never run


class Unit:
    """A module whose buckets are gathered and freed together.

    Attributes:
        index: position in the unit list (the root unit, the model, comes last).
        name: the module's name in the model (``blocks.1``; ``<model>`` for the root).
        buckets: its buckets, in backward order.
        gathering: all_gathers in flight (started, not yet waited for).
        gathered: every gather finished: the parameters hold their values.
        ran: its forward has started in the current forward pass.
        backward_gathered: its pre-backward gather already ran in this backward.
    """

    def __init__(self, index: int, name: str, module: nn.Module, buckets: list):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.gathering: list[comm.Handle] = []
        self.gathered = False
        self.ran = False
        self.backward_gathered = False

    def describe(self) -> str:
        return f"unit {self.index}: {self.name}, {type(self.module).__name__}"


def default_units(model: nn.Module) -> list[nn.Module]:
    """The model's children, a ModuleList's or ModuleDict's items in its place."""
    out = []
    for child in model.children():
        out += list(child.children()) if isinstance(child, CONTAINERS) else [child]
    return out


def assign(model: nn.Module, units: list[nn.Module] | None,
           trainable: list[tuple[str, nn.Parameter]]) -> tuple[list[nn.Module], list[list], dict[int, str]]:
    """Which unit owns each trainable parameter.

    Parameters outside every unit, parameters shared by several units (tied weights) and
    a unit's parameter shared with a module outside every unit go to the root unit, the
    model itself, gathered for the whole forward and backward.

    Returns:
        ``(modules, per_unit, names)``: the units with the root appended; per unit its
        ``(name, parameter)`` in registration order; module id -> name in the model.

    Raises:
        ConfigError: ``units`` contains a ModuleList or ModuleDict (no forward of its own).
    """
    names = {id(m): name or "<model>" for name, m in model.named_modules()}
    if units is None:
        units = model.units() if hasattr(model, "units") else default_units(model)
    for m in units:
        if isinstance(m, CONTAINERS):
            raise ConfigError(f"ZeRO-3: units= contains {names.get(id(m), '?')} ({type(m).__name__}), which "
                              "has no forward of its own, so it would never be gathered; pass its items "
                              f"instead (units=[*{names.get(id(m), 'container')}, ...])")
    root = len(units)
    owner: dict[int, int] = {}
    for u, module in enumerate(units):
        for p in module.parameters():
            owner[id(p)] = root if owner.get(id(p), u) != u else u
    # Shared with a module outside every unit (Qwen2's lm_head tied to a unit's embedding):
    # used in the root's forward too, so the root's.
    prefixes = tuple(names[id(m)] + "." for m in units if id(m) in names and m is not model)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not name.startswith(prefixes):
            owner[id(p)] = root
    modules = [*units, model]
    per_unit: list[list] = [[] for _ in modules]
    for name, p in trainable:
        per_unit[owner.get(id(p), root)].append((name, p))
    return modules, per_unit, names


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

    def __init__(self, param_unit: dict[int, tuple[str, Unit]]):
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


def refuse_read(name: str, unit: Unit) -> None:
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


# ----- backward: saved tensors of a unit come back gathered ------------------------------
class Saved:
    """A tensor autograd saved from a unit's buffer, with the unit to gather first."""

    __slots__ = ("tensor", "unit")

    def __init__(self, tensor: torch.Tensor, unit: Unit):
        self.tensor, self.unit = tensor, unit


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, the same before and after it is resized."""
    return t.untyped_storage()._cdata


def tensors_in(output) -> list[torch.Tensor]:
    """The tensors in a unit's output: nested lists, tuples, dicts and dataclasses."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in tensors_in(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in tensors_in(o)]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [t for f in dataclasses.fields(output) for t in tensors_in(getattr(output, f.name))]
    return []


# ----- every rank does the same thing ----------------------------------------------------
def agree_forward(unit: Unit, proposal: guard.Proposal, units: list[Unit], pg) -> None:
    """Check that every rank is about to run ``unit``'s forward (``proposal``: each rank's
    unit index, gathered asynchronously by :func:`guard.propose`).

    Raises:
        ConfigError: the ranks are about to run different units, each rank named with its unit.
    """
    indices = proposal.result()
    if len(set(indices)) == 1:
        return
    by_index = {u.index: u for u in units}
    doing = "; ".join(f"rank {r} runs {by_index[i].describe()}" for r, i in zip(guard.group_ranks(pg), indices))
    raise ConfigError(
        f"ZeRO-3: ranks are about to run different units ({doing}): the model took a different branch "
        "on these ranks (an if around a unit that depends on the rank or its data). Every rank must run "
        "the same units in the same order; a module that runs on some ranks only can be left out of units= "
        "(its parameters then belong to the root unit, gathered for the whole forward).")


def units_reached(loss: torch.Tensor, param_unit: dict[int, tuple[str, Unit]]) -> list[int]:
    """Indices of the units some of whose parameters get a gradient from ``loss``.

    Walks ``loss``'s autograd graph (as DDP's ``find_unused_parameters`` does): a
    parameter gets a gradient when its accumulation node is reachable.
    """
    seen, stack, reached = set(), [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf tensor
        if variable is not None and id(variable) in param_unit:
            reached.add(param_unit[id(variable)][1].index)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return sorted(reached)


def agree_backward(reached: list[int], units: list[Unit], pg, device) -> None:
    """Check, once before backward, that every rank computes gradients for the same units
    (one 8-byte all_gather; the sets themselves are exchanged only when they differ).

    Raises:
        ConfigError: some units get gradients on some ranks only, each named with its ranks.
    """
    code = zlib.crc32(",".join(map(str, reached)).encode())
    if len(set(guard.propose(code, pg, device).result())) == 1:
        return
    everyone = comm.gather_objects(reached, group=pg)
    ranks = guard.group_ranks(pg)
    by_index = {u.index: u for u in units}
    differ = sorted(set().union(*map(set, everyone)) - set.intersection(*map(set, everyone)))
    doing = "; ".join(f"{by_index[i].describe()} on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))} "
                      "only" for i in differ for on in [[r for r, got in zip(ranks, everyone) if i in got]])
    raise ConfigError(
        f"ZeRO-3: ranks are about to compute gradients for different units ({doing}): some parameters "
        "get gradients on some ranks only (a unit whose output only some ranks use, or a branch that "
        "depends on the rank or its data), so the ranks would gather different units in backward. Leave "
        "such a module out of units= (its parameters then belong to the root unit, gathered for the whole "
        "backward and reduced at its end on every rank).")
