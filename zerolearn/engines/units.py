"""ZeRO-3's units, and the guards that keep the model and the ranks to them.

A unit is a module whose buckets ZeRO-3 gathers and frees together (paper Sec 5.3);
:mod:`zerolearn.engines.zero3` says when. This file says which parameters belong to
which unit (:func:`assign`) and checks, as FSDP2 does by looking at its parameters'
state, that nothing goes wrong silently around them:

* the model may read a unit's parameters only while the unit is gathered
  (:class:`ReadGuard`, a ``TorchFunctionMode`` run during forward; a read elsewhere
  is a ConfigError naming the parameter, its unit and the fix, before any arithmetic);
* in debug mode (``ZEROLEARN_DEBUG_COLLECTIVES=1``, ``debug_collectives=True``), every rank
  runs the same units and computes gradients for the same units, so a branch taken on
  some ranks only is named at once instead of pairing gathers of different sizes: one
  8-byte all_gather per forward once the ranks share a schedule (one per unit before
  that, :class:`Schedule`) and one before backward (:func:`agree_backward`), outside the
  ledger. Without it nothing is exchanged and nothing read on the host, as torch's
  DDP checks only at ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerolearn import comm, guard
from zerolearn.errors import ConfigError, require_real
from zerolearn.memory.ledger import category

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # modules with no forward: their hooks never run


def is_container(m: nn.Module) -> bool:
    """``m`` is a ModuleList or ModuleDict with no forward of its own (a subclass that
    defines one, as Switch Transformer's experts do, runs like any module)."""
    return isinstance(m, CONTAINERS) and type(m).forward is nn.Module.forward


class Unit:
    """A module whose buckets are gathered and freed together.

    Attributes:
        index: position in the unit list (the root unit, the model, comes last).
        name: the module's name in the model (``blocks.1``; ``<model>`` for the root).
        buckets: its buckets, in backward order.
        gathering: all_gathers in flight (started, not yet waited for).
        gathered: every gather finished: the parameters hold their values. Setting it
            swaps the class of the parameters :meth:`ShardedParameter.adopt` made sharded:
            plain ``nn.Parameter`` while gathered (torch's ops on them pay no Python
            check), :class:`ShardedParameter` while freed (every op checked).
        ran: its forward has started in the current forward pass.
        backward_gathered: its pre-backward gather already ran in this backward.
        in_forward: the engine's forward runs (a read of a freed parameter then names the
            unit's forward, :func:`refuse_read`).
    """

    def __init__(self, index: int, name: str, module: nn.Module, buckets: list):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.gathering: list[comm.Handle] = []
        self._gathered = False
        self.sharded: list[nn.Parameter] = []  # parameters whose class follows `gathered` (adopt)
        self.ran = False
        self.backward_gathered = False
        self.in_forward = False

    @property
    def gathered(self) -> bool:
        return self._gathered

    @gathered.setter
    def gathered(self, value: bool) -> None:
        value = bool(value)
        if value != self._gathered:
            # The guard's price paid once per gather and once per free, not per op.
            cls = nn.Parameter if value else ShardedParameter
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
    """One all_gather for the buckets of several units: a fused buffer (CB, Sec 6.2).

    The buckets' shards are laid side by side in one send buffer, so a rank's pieces of
    all of them travel in one collective; every rank's pieces land in one receive buffer,
    (Nd, sum of shard sizes), and :meth:`wait` copies each bucket's column into its full
    buffer (Nd shards, in rank order, as a bucket's own all_gather would leave them). The
    bytes counted are those of one all_gather per bucket; the calls are one.

    Args:
        buckets: the buckets to gather, their ``full`` storage already allocated.
        group: the data-parallel process group.
    """

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
        self._handle, start = None, 0
        rows = self.recv.view(self.ranks, -1)  # row r: rank r's shards, side by side
        for b in self.buckets:
            n = b.layout.shard_numel
            b.full.view(self.ranks, n).copy_(rows[:, start:start + n])
            start += n
        self.recv = self.buckets = None


PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)  # parameters a parent reads, no forward


def default_units(model: nn.Module) -> list[nn.Module]:
    """The model's children, a ModuleList's or ModuleDict's items in its place; a
    ParameterList or ParameterDict child is no unit (it has no forward: the parent that
    reads its parameters owns them, gathered with the root unit)."""
    out = []
    for child in model.children():
        if isinstance(child, PARAMETER_CONTAINERS):
            continue
        out += list(child.children()) if is_container(child) else [child]
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

    zero3: tuple[str, Unit]

    @classmethod
    def adopt(cls, bucket, unit: Unit) -> None:
        """Make ``bucket``'s plain ``nn.Parameter`` objects sharded parameters of ``unit``
        (of this class while ``unit`` is not gathered; a subclass of the user's own keeps
        its class and is not guarded)."""
        for name, p in zip(bucket.layout.names, bucket.params):
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


def refuse_outside(name: str, unit: Unit, op: str | None) -> None:
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


def refuse_load_outside_summon(module: nn.Module, param_unit: dict[int, tuple[str, Unit]]) -> None:
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


def unit_hooks(units: list[Unit], pre_forward, post_forward) -> list:
    """Each unit's forward pre-hook ``pre_forward(unit)`` and forward hook
    ``post_forward(unit, output)``; their handles. The pre-hook is prepended: the unit is
    gathered before any pre-hook of the user's runs (a hook-based ``weight_norm`` or
    ``spectral_norm`` computes the weight from the unit's parameters), as FSDP2 does."""
    return [h for unit in units for h in (
        unit.module.register_forward_pre_hook(lambda m, a, unit=unit: pre_forward(unit), prepend=True),
        unit.module.register_forward_hook(lambda m, a, out, unit=unit: post_forward(unit, out)))]


def guard_load_state_dict(model: nn.Module, param_unit: dict[int, tuple[str, Unit]]) -> list:
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
DEFAULT_PREFETCH_MB = 4.0  # one prefetch's most bytes of units smaller than that, gathered together


def prefetch_bytes(prefetch_mb: float | None) -> int:
    """Bytes of the option ``prefetch_mb`` (MiB): what one prefetch may gather at once, in
    one fused all_gather when that is several units (:meth:`Schedule.window`; the engine
    also caps it at a bucket). None: :data:`DEFAULT_PREFETCH_MB`; 0: one unit per
    all_gather (the next unit is still gathered ahead). The paper has no units and no
    prefetch: Sec 7.2.2 says stage 3's all-gather is pipelined across forward and
    backward, and units with prefetch are how this package (like DeepSpeed and FSDP)
    implements that pipelining.

    The fused buffer is a constant-size buffer (CB, Sec 6.2): it and the units' own
    buffers exist together while a fused gather lands, so the most memory it adds is
    about twice ``prefetch_mb``.

    Raises:
        ConfigError: ``prefetch_mb`` is not a finite number >= 0.
    """
    if prefetch_mb is None:
        return int(DEFAULT_PREFETCH_MB * 2**20)
    require_real("prefetch_mb", prefetch_mb, strict=False)
    return int(prefetch_mb * 2**20)


END = -1  # a forward's end, proposed like a unit: a rank that stops early is named too
ON_SCHEDULE = -1  # what a rank that ran the whole schedule says at the forward's end


class Schedule:
    """Which units every rank runs in forward, agreed on with as few collectives as possible.

    A rank on another code path (a branch taken on some ranks only) must be named
    before anything pairs wrongly: gloo aborts the process when gathers of two sizes
    meet, and units of one size would mix silently. Two modes:

    Without debug mode nothing is exchanged: the first forward (and one with nested
    units, or off the schedule) prefetches in ``units=`` order, later ones follow the
    schedule, and a forward that leaves it goes on in ``units=`` order; every rank that
    runs the same units issues the same gathers. In debug mode (:func:`guard.debug_enabled`):

    * *lockstep* (the first forward, after a forward with nested units, every forward):
      before each unit's forward the ranks exchange its index
      (:func:`guard.propose`, 8 bytes that pair whatever they say) and check it, then
      gather it and prefetch the unit after it in ``units=`` order; the forward's end
      is proposed too (:data:`END`). A forward whose units never nested becomes the
      *schedule*.
    * *scheduled* (every later forward): each unit's forward runs without a check,
      prefetching the unit the schedule has next, so every rank issues the same
      gathers, whatever it runs. A rank that leaves the schedule (another unit, a unit
      inside another, an early end) knows it: it first issues the gathers the others
      still issue to the schedule's end (:meth:`_leave`, through the engine's own
      gather and free), then all ranks meet in one exchange at the end of forward. If
      every rank left the schedule at the same point for the same unit, they go on in
      lockstep; otherwise every rank raises with the message below, with every
      collective paired (the process group stays usable).

    One 8-byte exchange per forward in debug mode once scheduled, instead of one per unit.

    Args:
        units: the engine's units in ``units=`` order, the root (the model) last if it has
            parameters (``root``).

    Raises:
        ConfigError: ranks run different units at one position, or one rank ends its
            forward while another runs a unit; each rank named with what it runs.
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

    def enter(self, unit: Unit, engine) -> list[Unit]:
        """``unit``'s forward starts; returns the units to prefetch (:meth:`window`)."""
        position, outer = len(self.ran), list(self.open)  # outer: units this one starts inside
        self.ran.append(unit.index)
        if unit.index != self.root:
            self.flat = self.flat and not outer
            self.open.append(unit)
        if self.lockstep:
            if self.checked:
                self._agree(position, unit.index)
        elif unit.index == self.trace[position] and not outer:
            return self._scheduled(position)
        elif self.checked:
            self._leave(position, unit.index, outer, engine)  # every rank left here alike: lockstep now
        else:
            self.lockstep = True  # off the schedule: units= order from here, as on every rank that left here
        return self._after(unit)

    def exit(self, unit: Unit) -> None:
        """``unit``'s forward returned."""
        if unit in self.open:
            self.open.remove(unit)

    def finish(self, engine) -> None:
        """The forward ended on this rank: check it with the others; an agreed flat forward
        becomes the schedule."""
        position = len(self.ran)
        if not self.checked:
            pass
        elif self.lockstep:
            self._agree(position, END)
        elif self.trace[position] != END:
            self._leave(position, END, list(self.open), engine)
        else:
            said = guard.propose(ON_SCHEDULE, self.pg, self.device).result()
            if any(v != ON_SCHEDULE for v in said):
                self._refuse(said)
        self.trace = [*self.ran, END] if self.flat else None

    # ----- inside -------------------------------------------------------------------------
    def window(self, units: list[Unit]) -> list[Unit]:
        """The first of ``units`` and those after it while all together hold at most
        ``window_bytes``: what one prefetch gathers, in one all_gather when more than one."""
        out, size = [], 0
        for unit in units if self.prefetch else ():
            size += unit.nbytes
            if out and size > self.window_bytes:
                break
            out.append(unit)
        return out

    def _scheduled(self, position: int) -> list[Unit]:
        ahead = []
        for index in self.trace[position + 1:]:
            if index in (END, self.root):
                break
            ahead.append(self.by_index[index])
        return self.window(ahead)

    def _after(self, unit: Unit) -> list[Unit]:  # lockstep's prefetch: the units after it in units= order
        i = self.units.index(unit) + 1
        return self.window([u for u in self.units[i:] if u.index != self.root])

    def _agree(self, position: int, index: int) -> None:
        said = guard.propose(index, self.pg, self.device).result()
        if len(set(said)) > 1:
            self._refuse([position << 20 | (i + 1) for i in said])

    def _leave(self, position: int, index: int, outer: list[Unit], engine) -> None:
        """This rank runs ``index`` at ``position``, off the schedule (inside the units
        ``outer``): issue what a rank on the schedule issues from here to the forward's
        end, through the engine's own gather and free, without computing; then exchange
        where each rank left the schedule."""
        for unit in outer:
            engine._free_unit(unit)  # on the schedule, no unit is inside another: they were closed
        for k in range(position, len(self.trace) - 1):
            unit = self.by_index[self.trace[k]]
            engine._start_gather(self._scheduled(k))
            engine._gather(unit)
            if unit.index != self.root:
                engine._free_unit(unit)
        said = guard.propose(position << 20 | (index + 1), self.pg, self.device).result()
        if len(set(said)) > 1:
            self._refuse(said)
        self.lockstep = True  # every rank left the schedule here, for the same unit
        for unit in outer:
            engine._gather(unit)

    def _refuse(self, said: list[int]) -> None:
        """``said``: per rank, ``position << 20 | (unit index + 1)`` where it left the
        schedule, or :data:`ON_SCHEDULE`."""
        first = min(v >> 20 for v in said if v != ON_SCHEDULE)
        runs = [(v & (1 << 20) - 1) - 1 if v != ON_SCHEDULE and v >> 20 == first else self.trace[first]
                for v in said]
        doing = "; ".join(f"rank {r} " + ("ends its forward" if i == END else f"runs {self.by_index[i].describe()}")
                          for r, i in zip(guard.group_ranks(self.pg), runs))
        raise ConfigError(
            f"ZeRO-3: ranks are about to run different units ({doing}; unit number {first} of this forward): "
            "the model took a different branch on these ranks (an if around a unit that depends on the rank or "
            "its data). Every rank must run the same units in the same order; a module that runs on some ranks "
            "only can be left out of units= (its parameters then belong to the root unit, gathered for the "
            "whole forward).")


def params_reached(loss, param_unit: dict[int, tuple[str, Unit]]) -> set[int]:
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

    def __init__(self, units: list[Unit], param_unit: dict[int, tuple[str, Unit]]):
        self.slots = [(b, i, unit.index) for unit in units for b in unit.buckets for i in range(len(b.params))]
        self.slot_of = {id(b.params[i]): k for k, (b, i, _) in enumerate(self.slots)}
        self.param_unit = param_unit

    def count(self, roots: list, units: list[Unit], pg, device, check: bool = False) -> int:
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


def agree_backward(reached: list[int], units: list[Unit], pg, device) -> None:
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


def _refuse_backward(everyone: list[list[int]], units: list[Unit], pg) -> None:
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
