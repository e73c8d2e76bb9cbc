"""ZeRO-3's units (paper Sec 5.3): what is gathered together, in what order, what a freed parameter answers and
which units a backward reaches; nothing here calls the engine."""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from zerolearn import comm, guard
from zerolearn.errors import ConfigError, require_real
from zerolearn.memory.ledger import category

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # modules with no forward: their hooks never run


def is_container(m: nn.Module) -> bool:
    """``m`` is a ModuleList or ModuleDict without a forward of its own."""
    return isinstance(m, CONTAINERS) and type(m).forward is nn.Module.forward


class Unit:
    """A module whose ``buckets`` (in backward order) are gathered and freed together; ``index``: its
    position (the root unit, the model, last); ``name``: ``blocks.1``, or ``<model>`` for the root."""

    def __init__(self, index: int, name: str, module: nn.Module, buckets: list):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.gathering: list[comm.Handle] = []  # all_gathers in flight
        self._gathered = False
        self.sharded: list[nn.Parameter] = []  # parameters whose class follows `gathered` (adopt)
        self.ran = False  # its forward started in this forward pass
        self.backward_gathered = False  # gathered in this backward
        self.in_forward = False  # the engine's forward runs

    @property
    def gathered(self) -> bool:
        return self._gathered

    @gathered.setter
    def gathered(self, value: bool) -> None:
        value = bool(value)
        if value != self._gathered:  # adopt's parameters swap class: once per gather and once per free
            cls = nn.Parameter if value else ShardedParameter  # a read of it refuses
            for p in self.sharded:
                p.__class__ = cls
        self._gathered = value

    def describe(self) -> str:
        return f"unit {self.index}: {self.name}, {type(self.module).__name__}"

    @property
    def nbytes(self) -> int:
        """Bytes of its parameters when gathered (padding included)."""
        return sum(b.layout.padded_numel * b.full.element_size() for b in self.buckets)


class FusedGather:
    """One all_gather for the ``buckets`` (their ``full`` storage allocated) of several units over the
    data-parallel ``group``, through a fused buffer (CB, Sec 6.2) of shape (Nd, sum of shard sizes);
    :meth:`wait` copies each bucket's column into its full buffer. Bytes counted: one all_gather per bucket."""

    def __init__(self, buckets: list, group):
        self.buckets, self.ranks = buckets, torch.distributed.get_world_size(group)
        with category("temporary"):
            send = torch.cat([b.shard for b in buckets])
            self.recv = torch.empty(self.ranks * send.numel(), dtype=send.dtype, device=send.device)
        self.nbytes = self.recv.nbytes
        self._handle = comm.all_gather(self.recv, send, group=group, async_op=True)

    def wait(self) -> None:
        if self._handle is None:
            return
        self._handle.wait()
        self._handle = None
        rows = self.recv.view(self.ranks, -1)  # row r: rank r's shards, side by side
        columns = rows.split([b.layout.shard_numel for b in self.buckets], dim=1)
        for b, column in zip(self.buckets, columns, strict=True):
            b.full.view_as(column).copy_(column)
        self.recv = self.buckets = None


PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)  # parameters a parent reads, no forward


def default_units(model: nn.Module) -> list[nn.Module]:
    """The model's children, a ModuleList's or ModuleDict's items in its place, Parameter containers left out."""
    children = [c for c in model.children() if not isinstance(c, PARAMETER_CONTAINERS)]
    return [m for c in children for m in (c.children() if is_container(c) else [c])]


def assign(model: nn.Module, units: list[nn.Module] | None,
           trainable: list[tuple[str, nn.Parameter]]) -> tuple[list[nn.Module], list[list], dict[int, str]]:
    """Which unit owns each trainable parameter (the root unit, the model, owns those outside every unit or shared).

    Returns:
        ``(modules, per_unit, names)``: units, root last; per unit ``(name, parameter)``s; id -> module name.

    Raises:
        ConfigError: ``units`` contains a Module- or ParameterList or -Dict (no forward of its own).
    """
    names = {id(m): name or "<model>" for name, m in model.named_modules()}
    if units is None:
        units = model.units() if hasattr(model, "units") else default_units(model)
    for m in units:
        if isinstance(m, PARAMETER_CONTAINERS):
            raise ConfigError(f"ZeRO-3: units= contains {names.get(id(m), '?')} ({type(m).__name__}), which has no "
                              "forward of its own, so it would never be gathered; leave it out (its parameters "
                              "then belong to the root unit) or pass the module that reads them")
        if is_container(m):
            raise ConfigError(f"ZeRO-3: units= contains {names.get(id(m), '?')} ({type(m).__name__}), which "
                              "has no forward of its own, so it would never be gathered; pass its items "
                              f"instead (units=[*{names.get(id(m), 'container')}, ...])")
    root = len(units)
    owner: dict[int, int] = {}
    for u, module in enumerate(units):
        for p in module.parameters():
            owner[id(p)] = root if owner.get(id(p), u) != u else u
    # Shared with a module outside every unit (Qwen2's lm_head tied to an embedding): the root's.
    prefixes = tuple(names[id(m)] + "." for m in units if id(m) in names and m is not model)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not name.startswith(prefixes):
            owner[id(p)] = root
    modules = [*units, model]
    per_unit: list[list] = [[] for _ in modules]
    for name, p in trainable:
        per_unit[owner.get(id(p), root)].append((name, p))
    return modules, per_unit, names


def unit_hooks(units: list[Unit], pre_forward, post_forward) -> list:
    """Handles of each unit's hooks ``pre_forward(unit)`` (first, as FSDP2's) and ``post_forward(unit, output)``."""
    return [h for unit in units for h in (
        unit.module.register_forward_pre_hook(lambda m, a, unit=unit: pre_forward(unit), prepend=True),
        unit.module.register_forward_hook(lambda m, a, out, unit=unit: post_forward(unit, out)))]


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


@dataclasses.dataclass(slots=True, eq=False)
class Saved:
    """A tensor autograd saved from a unit's buffer, with the unit to gather first."""

    tensor: torch.Tensor
    unit: Unit


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, the same before and after it is resized."""
    return t.untyped_storage()._cdata


def own_copies(output, storage_unit: dict, unit: Unit):
    """``output`` of ``unit``'s forward, each view of a unit's buffer (``self.weight[:n]``) replaced by a copy.

    Raises:
        ConfigError: such a view inside anything but a tensor, list or tuple.
    """
    if not any(storage_key(t) in storage_unit for t in tensors_in(output)):
        return output
    if torch.is_tensor(output):
        return output.clone()
    if type(output) not in (list, tuple):
        refuse_view_output(unit, output)
    return type(output)(t.clone() if torch.is_tensor(t) and storage_key(t) in storage_unit else t for t in output)


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


# Tensor methods and attributes that read no element: allowed on any parameter (Hugging Face reads self.dtype).
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "ndimension", "numel", "nelement", "__len__",
                       "stride", "storage_offset", "element_size", "is_floating_point", "is_complex",
                       "is_contiguous", "get_device", "data_ptr", "untyped_storage", "__hash__",
                       "requires_grad_", "register_hook", "register_post_accumulate_grad_hook"})


def _ungathered(args, kwargs, find):
    """Each parameter among an op's arguments (or in a list or tuple of them) and its ``find(parameter)``,
    ``(name, unit)``, where its unit is not gathered."""
    for a in (*args, *kwargs.values()):
        for p in a if isinstance(a, (list, tuple)) else [a]:
            found = find(p) if isinstance(p, nn.Parameter) else None
            if found is not None and not found[1].gathered:
                yield p, found


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
            for p, found in _ungathered(args, kwargs, lambda p: getattr(p, "zero3", None)):
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


def refuse_view_output(unit, output) -> None:
    """Raise the ConfigError for a view of ``unit``'s parameters returned inside a ``type(output)``."""
    raise ConfigError(
        f"ZeRO-3: {unit.describe()} returned a view of its own parameter inside a {type(output).__name__}; "
        "its parameters are freed when its forward returns, so the view would hold nothing. Return a copy "
        "(self.weight[:n].clone()) or a tensor, list or tuple of outputs (the engine copies a view there)")


def params_reached(roots: list, param_unit: dict[int, tuple]) -> set[int]:
    """``id`` of each sharded parameter the autograd nodes ``roots`` reach, as DDP's ``find_unused_parameters``."""
    seen, stack, reached = set(), list(roots), set()
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

    def count(self, roots: list, units: list, pg, device, check=None) -> int:
        """Count as arrived (``ready``, gradient zeros) each parameter of a reached unit that gets no gradient
        here, so its bucket completes in its unit's backward on every rank; returns how many. ``check``: debug
        mode's :func:`zero3_checks.agree_backward`, given the reached units first.

        Raises:
            ConfigError: from ``check``.
        """
        mine = {self.slot_of[i] for i in params_reached(roots, self.param_unit) if i in self.slot_of}
        reached_units = sorted({self.slots[k][2] for k in mine})
        if check is not None:
            check(reached_units, units, pg, device)
        missing = [b for k, (b, _, u) in enumerate(self.slots) if k not in mine and u in reached_units]
        for b in missing:
            b.ready += 1
        return len(missing)


DEFAULT_PREFETCH_MB = 4.0  # one prefetch's most bytes of units smaller than that, gathered together


def prefetch_bytes(prefetch_mb: float | None) -> int:
    """Bytes of ``prefetch_mb`` (MiB; None: :data:`DEFAULT_PREFETCH_MB`; 0: one unit per all_gather): one prefetch
    (Sec 7.2.2's pipelining), fused in a CB (Sec 6.2) of at most a bucket, adding at most about twice that memory.

    Raises:
        ConfigError: ``prefetch_mb`` is not a finite number >= 0.
    """
    mb = DEFAULT_PREFETCH_MB if prefetch_mb is None else prefetch_mb
    require_real("prefetch_mb", mb, strict=False)
    return int(mb * 2**20)


END = -1  # a forward's end, proposed like a unit: a rank that stops early is named too


class Schedule:
    """Which units every rank runs in forward (``units``: in ``units=`` order, the model last if ``root``).

    A forward whose units never nested becomes the schedule, which the next ones prefetch from; the others
    go in ``units=`` order (lockstep), as every forward in debug mode, where the ranks check each unit and
    the end (:data:`END`) with :func:`guard.propose` (8 bytes).

    Raises:
        ConfigError: ranks about to run different units, or one ends its forward early; each rank named.
    """

    def __init__(self, units: list[Unit], root: bool, pg, device, window_bytes: int = 0):
        self.units, self.by_index = units, {u.index: u for u in units}
        self.root = units[-1].index if root else None
        self.pg, self.device = pg, device
        self.trace: list[int] | None = None  # unit indices (then END) of the last agreed forward
        self.prefetch = True  # False: no unit gathered before its own hook (chapter 4's timeline)
        self.window_bytes = window_bytes  # a prefetch gathers following units up to this many bytes
        self.start()
        self.stop()  # no forward runs yet

    def start(self) -> None:
        """A new forward: nothing has run."""
        self.ran: list[int] = []  # unit indices, in the order their forward started
        self.open: list[Unit] = []  # units (not the root) whose forward has started, not returned
        self.flat = True  # no unit's forward started inside another's
        self.checked = guard.debug_enabled()  # ranks compare the units they run
        self.lockstep = self.trace is None or self.checked
        for unit in self.units:
            unit.ran = False
            unit.in_forward = True

    def stop(self) -> None:
        """The engine's forward returned or failed."""
        for unit in self.units:
            unit.in_forward = False

    def enter(self, unit: Unit) -> list[Unit]:
        """``unit``'s forward starts: the units to prefetch (:meth:`window`)."""
        position, outer = len(self.ran), list(self.open)  # outer: units this one starts inside
        self.ran.append(unit.index)
        if unit.index != self.root:
            self.flat = self.flat and not outer
            self.open.append(unit)
        if self.lockstep:
            if self.checked:
                self._agree(position, unit.index)
        elif unit.index == self.trace[position] and not outer:  # on the schedule: its next units, to the root's
            ahead = itertools.takewhile(lambda i: i not in (END, self.root), self.trace[position + 1:])
            return self.window([self.by_index[i] for i in ahead])
        else:
            self.lockstep = True  # off the schedule: units= order from here, as on every rank that left here
        i = self.units.index(unit) + 1  # lockstep's prefetch: the units after it in units= order
        return self.window([u for u in self.units[i:] if u.index != self.root])

    def exit(self, unit: Unit) -> None:
        """``unit``'s forward returned."""
        if unit in self.open:
            self.open.remove(unit)

    def finish(self) -> None:
        """The forward ended here: checked in debug mode; a flat one becomes the schedule."""
        if self.checked:
            self._agree(len(self.ran), END)
        self.trace = [*self.ran, END] if self.flat else None

    def window(self, units: list[Unit]) -> list[Unit]:
        """The first of ``units`` and those after it within ``window_bytes``: one prefetch, one all_gather."""
        out, size = [], 0
        for unit in units if self.prefetch else ():
            size += unit.nbytes
            if out and size > self.window_bytes:
                break
            out.append(unit)
        return out

    def _agree(self, position: int, index: int) -> None:
        said = guard.propose(index, self.pg, self.device).result()
        if len(set(said)) > 1:
            self._refuse([position << 20 | (i + 1) for i in said])

    def _refuse(self, said: list[int]) -> None:
        """``said``: per rank, ``position << 20 | (unit index + 1)``."""
        first = min(v >> 20 for v in said)
        runs = [(v & (1 << 20) - 1) - 1 if v >> 20 == first else self.trace[first] for v in said]
        doing = "; ".join(f"rank {r} " + ("ends its forward" if i == END else f"runs {self.by_index[i].describe()}")
                          for r, i in zip(guard.group_ranks(self.pg), runs, strict=True))
        if len(set(runs)) == 1:  # the same unit on every rank, yet not on the same schedule
            raise ConfigError(
                f"ZeRO-3: ranks are at different points of their steps ({doing}, each at another point of the "
                "schedule of units): a rank skipped a forward, a "
                "backward or a step that the others ran (a `continue` for a NaN loss on some ranks only). Every "
                "rank must run every forward and backward; skip a bad batch on all ranks at once (reduce a flag "
                "with dist.all_reduce first)")
        raise ConfigError(
            f"ZeRO-3: ranks are about to run different units ({doing}; unit number {first} of this forward): "
            "the model took a different branch on these ranks (an if around a unit that depends on the rank or "
            "its data). Every rank must run the same units in the same order; a module that runs on some ranks "
            "only can be left out of units= (its parameters then belong to the root unit, gathered for the "
            "whole forward).")
