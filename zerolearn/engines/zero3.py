"""Stage 3, P_os+g+p: partition the parameters too (paper Sec 5.3, Sec 7.2.2).

Between uses, a rank keeps only its 1/Nd shard of every parameter: (2 + 2 + K) Psi
/ Nd bytes of model states (Fig 1). The model is cut into *units* (here a
transformer block, the embedding, the head); a unit's parameters are all-gathered
just before its forward, freed right after, gathered again just before its
backward and freed once its gradients are in. While one unit computes, the next
one's all_gather is already in flight (prefetch), so live parameter memory is the
shards plus about two gathered units.

Traffic: Psi all-gathered in forward, Psi again in backward, Psi reduce-scattered
as gradients: 3 Psi per step, 1.5x DP's, for an Nd-fold cut in memory (Sec 7.2.2).

How a gathered unit is freed matters. Autograd saves the weights a layer needs for
backward; if "freeing" only reassigned ``param.data``, those saved references would
keep the memory alive. Instead each unit's flat buffer keeps its tensor object and
its *storage* is resized to 0 bytes, then back to full size and re-filled before
backward reads it: the views autograd saved point into that storage, so they see
the gathered values again, and while freed they really hold no memory.

Shared parameters (tied embeddings: GPT-2's ``lm_head.weight is wte.weight``) belong
to two units. They go to the root unit, the model itself, which is gathered for the
whole forward and the whole backward, so every user finds them gathered; the cost is
that those parameters stay gathered throughout (FSDP2 and DeepSpeed make the same
trade for a tied weight that is used far apart).

A parameter exists only while its unit is gathered, so the engine makes sure nothing
computes on it at any other time, as FSDP2 does by checking its parameters' state:

* forward: every torch op runs through a guard (a ``TorchFunctionMode``) that looks
  at the parameters among its arguments; one whose unit is not gathered (its forward
  has returned, has not run yet, or is only prefetched) stops the forward with a
  ConfigError naming the parameter, its unit and the fix, before any arithmetic;
* backward: every tensor autograd saved from a unit's buffer is unpacked through a
  hook (``saved_tensors_hooks``) that first gathers the unit if it is not gathered,
  whatever the model's outputs are (the hooks on a unit's output tensors only
  prefetch);
* a gather in flight is always waited for before its buffer is used or freed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerolearn import comm, guard
from zerolearn.dist import ConfigError
from zerolearn.engines.group import GroupState
from zerolearn.engines.zero2 import Zero2Engine


class Unit:
    """A module whose flat groups are gathered and freed together.

    Attributes:
        index: position in the unit list (the root unit, the model, comes last).
        name: the module's name in the model (``blocks.1``; ``<model>`` for the root),
            for messages and debug-mode fingerprints.
        gathering: all_gathers in flight (started, not yet waited for).
        gathered: every gather finished: the parameters hold their values.
        ran: its forward has started in the current forward pass.
    """

    def __init__(self, index: int, name: str, module: nn.Module, groups: list[GroupState]):
        self.index, self.name, self.module, self.groups = index, name, module, groups
        self.gathering: list[comm.Handle] = []
        self.gathered = False
        self.ran = False
        self.backward_gathered = False  # pre-backward already ran in this backward

    def describe(self) -> str:
        return f"unit {self.index}: {self.name}, {type(self.module).__name__}"


def _free(g: GroupState) -> None:
    g.full.untyped_storage().resize_(0)


CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # modules with no forward: their hooks never run


class Zero3Engine(Zero2Engine):
    """Stage 3 (P_os+g+p): sharded params, grads and optimizer states; per-unit gather.

    Memory per rank (bytes): (2 + 2 + K) Psi / Nd (+ padding) between units, plus
    at most about two gathered units during forward and backward.
    Traffic per step: all_gather 2 Psi + reduce_scatter Psi elements.

    Default units are the model's direct children, with an ``nn.ModuleList`` or
    ``nn.ModuleDict`` child replaced by its items (a container has no forward).

    Before each unit's forward the ranks check that they all run that unit (one
    8-byte all_gather, outside the ledger, that travels while the unit's prefetched
    gather is waited for), so a branch taken on some ranks only is named at once
    instead of pairing gathers of different units. In backward the ranks check the
    same way before each gather and each reduction, which follow the gradients a rank
    got (a unit whose output only some ranks use).

    Raises:
        ConfigError: (construction) a unit passed in ``units=`` is a ModuleList or
            ModuleDict; (forward) the model read a parameter whose unit was not
            gathered: outside that unit's forward; ranks are about to run different
            units; (backward) ranks are about to gather or reduce different things.
    """

    stage = 3
    peak_gathered_bytes = 0  # most bytes of gathered (full) parameters alive at once

    # ----- layout: groups never cross a unit boundary ------------------------------
    def _build_groups(self, trainable, units) -> list[GroupState]:
        names = {id(m): name or "<model>" for name, m in self.model.named_modules()}
        if units is None:
            units = self.model.units() if hasattr(self.model, "units") else _default_units(self.model)
        for m in units:
            if isinstance(m, CONTAINERS):
                raise ConfigError(f"ZeRO-3: units= contains {names.get(id(m), '?')} ({type(m).__name__}), which "
                                  "has no forward of its own, so it would never be gathered; pass its items "
                                  f"instead (units=[*{names.get(id(m), 'container')}, ...])")
        # Parameters outside every unit, and parameters shared by several units (tied
        # weights), form a last unit, the root, around the whole model.
        root = len(units)
        owner: dict[int, int] = {}
        for u, module in enumerate(units):
            for p in module.parameters():
                owner[id(p)] = root if owner.get(id(p), u) != u else u
        # A unit's parameter that a module outside every unit shares (Qwen2's lm_head
        # tied to a unit's embedding) is used in the root's forward too: root's.
        prefixes = tuple(names[id(m)] + "." for m in units if id(m) in names and m is not self.model)
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in owner and not name.startswith(prefixes):
                owner[id(p)] = root
        modules = [*units, self.model]
        per_unit: list[list] = [[] for _ in modules]
        for name, p in trainable:
            per_unit[owner.get(id(p), len(units))].append((name, p))
        self.units, groups = [], []
        # Backward order, as in the base class, but the root unit's groups last: they are
        # reduced at the end of backward (see _may_launch).
        for u in [*reversed(range(len(units))), root]:
            if not per_unit[u]:
                continue
            unit_groups = self._groups_of(per_unit[u][::-1])
            self.units.append(Unit(u, names.get(id(modules[u]), type(modules[u]).__name__), modules[u], unit_groups))
            groups += unit_groups
        self.units.sort(key=lambda unit: unit.index)  # forward order
        self._unit_of = {id(g): unit for unit in self.units for g in unit.groups}
        self._group_index = {id(g): i for i, g in enumerate(groups)}
        # What the guards look up: a parameter, or a storage autograd saved, -> its unit.
        self._param_unit = {id(p): (name, unit) for unit in self.units for g in unit.groups
                            for name, p in zip(g.layout.names, g.params)}
        self._storage_unit: dict[int, Unit] = {}  # filled by _init_group
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, a, unit=unit: self._pre_forward(unit))
            unit.module.register_forward_hook(lambda m, a, out, unit=unit: self._post_forward(unit, out))
        return groups

    def _init_group(self, g: GroupState, master32: torch.Tensor) -> None:
        full = master32.to(self.dtype)
        g.shard = g.layout.shard_of(full).clone()  # the only copy of the working params kept
        g.master = nn.Parameter(g.shard if not self.mixed else g.layout.shard_of(master32).clone())
        g.full = full
        g.layout.bind(g.params, full)  # parameters are views of the full buffer, whose storage we free
        self._storage_unit[_storage_key(full)] = self._unit_of[id(g)]
        _free(g)

    def forward(self, *args, **kwargs):
        for unit in self.units:
            unit.ran = False
        try:
            with _ReadGuard(self), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return super().forward(*args, **kwargs)
        except (guard.CollectiveError, guard.CollectiveMismatch):
            raise  # the process group is broken: waiting on it would hang
        except BaseException:
            self._settle()  # no gather left in flight, nothing left gathered
            raise

    def _refuse_read(self, name: str, unit: Unit) -> None:
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

    # ----- backward: saved tensors come back gathered -------------------------------
    def _pack(self, t: torch.Tensor):
        unit = self._storage_unit.get(_storage_key(t))
        return t if unit is None else _Saved(t, unit)

    def _unpack(self, saved):
        if isinstance(saved, _Saved):
            if not saved.unit.gathered:
                saved.unit.backward_gathered = True
                with comm.unit(saved.unit.name, "backward: gather"):
                    self._gather(saved.unit)
            return saved.tensor
        return saved

    # ----- gather / free -------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered or unit.gathering:
            return
        if self.in_backward:
            self._check_backward(unit.index)
        for g in unit.groups:
            g.full.untyped_storage().resize_(g.layout.padded_numel * g.full.element_size())
            self._track_buffer(g.full)
            unit.gathering.append(comm.all_gather(g.full, g.shard, group=self.pg, async_op=True))
        gathered = sum(g.full.untyped_storage().nbytes() for g in self.groups)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    # In backward, which units a rank gathers and when its groups' gradients are complete
    # follow the gradients it got: a unit whose output only some ranks use, or a branch
    # inside a unit, would make ranks issue gathers and reductions in different orders.
    # So before each of them the ranks check they are about to do the same thing.
    def _before_reduce(self, g: GroupState) -> None:
        self._check_backward(-1 - self._group_index[id(g)])

    def _check_backward(self, code: int) -> None:
        """``code``: a unit index (about to gather it) or -1 - a group index (about to
        reduce it); every rank must propose the same.

        Raises:
            ConfigError: ranks are about to issue different collectives in backward.
        """
        codes = guard.propose(code, self.pg, self.device).result()
        if len(set(codes)) == 1:
            return
        by_index = {u.index: u for u in self.units}

        def what(c: int) -> str:
            if c >= 0:
                return f"gathers {by_index[c].describe()}"
            g = self.groups[-1 - c]
            return f"reduces {g.layout.label} ({self._unit_of[id(g)].describe()})"

        doing = "; ".join(f"rank {r} {what(c)}" for r, c in zip(guard.group_ranks(self.pg), codes))
        raise ConfigError(
            f"ZeRO-3: in backward, ranks are about to issue different collectives ({doing}): some parameters "
            "got gradients on some ranks only (a unit whose output only some ranks use, or a branch inside a "
            "unit that depends on the rank or its data). Leave such a module out of units= (its parameters "
            "then belong to the root unit, reduced at the end of backward on every rank).")

    def _check_agreement(self, proposal: guard.Proposal) -> None:
        """Every rank named the unit whose forward it is about to run (``proposal``,
        launched by :meth:`_pre_forward`); a rank that took another branch (skipped a
        unit, ran an extra one) is named here, before an all_gather of another size
        could pair with this one or a prefetch could hide it (8 bytes per rank per unit
        forward, outside the ledger).

        Raises:
            ConfigError: ranks are about to run different units.
        """
        indices = proposal.result()
        if len(set(indices)) == 1:
            return
        by_index = {u.index: u for u in self.units}
        ranks = guard.group_ranks(self.pg)
        doing = "; ".join(f"rank {r} runs {by_index[i].describe()}" for r, i in zip(ranks, indices))
        raise ConfigError(
            f"ZeRO-3: ranks are about to run different units ({doing}): the model took a different branch "
            "on these ranks (an if around a unit that depends on the rank or its data). Every rank must run "
            "the same units in the same order; a module that runs on some ranks only can be left out of units= "
            "(its parameters then belong to the root unit, gathered for the whole forward).")

    def _finish_gather(self, unit: Unit) -> None:
        """Wait for the unit's all_gathers in flight (a prefetch): its buffers are whole."""
        for handle in unit.gathering:
            handle.wait()
        if unit.gathering:
            unit.gathered = True
        unit.gathering.clear()

    def _gather(self, unit: Unit) -> None:
        self._start_gather(unit)
        self._finish_gather(unit)

    def _free_unit(self, unit: Unit) -> None:
        self._finish_gather(unit)  # a prefetch nobody used: its buffers may be freed only once it is done
        for g in unit.groups:
            _free(g)
        unit.gathered = False

    def _settle(self) -> None:
        """After a failed forward: wait for every gather in flight, free every unit."""
        for unit in self.units:
            self._free_unit(unit)
            unit.backward_gathered = False

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        i = self.units.index(unit) + step
        return self.units[i] if 0 <= i < len(self.units) else None

    def _pre_forward(self, unit: Unit) -> None:
        recompute = self.in_backward
        # The ranks' agreement on this unit is checked before this hook issues any
        # gather; while it travels, a prefetched gather of this unit is waited for.
        proposal = None if recompute else guard.propose(unit.index, self.pg, self.device)
        unit.ran = unit.ran or not recompute
        with comm.unit(unit.name, "forward: gather"):  # names this unit in debug mode
            if unit.gathering:
                self._finish_gather(unit)
            if proposal is not None:
                self._check_agreement(proposal)
            self._gather(unit)
            # Prefetch overlaps the next unit's gather with this compute. A forward inside
            # backward is a recomputation (activation checkpointing): backward walks the
            # units in reverse, so the one to prefetch is the previous one.
            nxt = self._neighbour(unit, -1 if self.in_backward else +1)
            if nxt is not None and nxt.module is not self.model:
                self._start_gather(nxt)

    def _post_forward(self, unit: Unit, output) -> None:
        if self.in_backward:
            return  # recomputed for backward, which needs the parameters next: keep them
        self._free_unit(unit)
        if torch.is_grad_enabled():
            # A hook on the unit's outputs runs when their gradient is ready, i.e. just
            # before autograd enters this unit's backward: gather it there (and prefetch
            # the unit before). Outputs it cannot see into are safe too: backward's
            # saved-tensor hook gathers on first use.
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        if unit.backward_gathered:
            return
        unit.backward_gathered = True
        with comm.unit(unit.name, "backward: gather"):
            self._gather(unit)
            prev = self._neighbour(unit, -1)
            if prev is not None:
                self._start_gather(prev)

    def _on_group_ready(self, g: GroupState) -> None:
        # All of g's gradients are in: backward no longer needs g's parameters.
        unit = self._unit_of[id(g)]
        self._finish_gather(unit)  # never free a buffer an all_gather is still writing
        _free(g)
        if all(other.complete for other in unit.groups):
            self._free_unit(unit)
        super()._on_group_ready(g)

    def _may_launch(self, g: GroupState) -> bool:
        # The root unit stays gathered through backward and may hold a parameter that
        # some ranks do not use (a branch left out of units=): its gradients are complete
        # on those ranks only at the end of backward, so every rank reduces them there,
        # after every backward gather, and collectives are issued in one order everywhere.
        return g.complete and self._unit_of[id(g)].module is not self.model

    def _abandon_backward(self, error: Exception) -> None:
        super()._abandon_backward(error)
        if not isinstance(error, (guard.CollectiveError, guard.CollectiveMismatch)):
            self._settle()

    def _after_backward(self) -> None:
        for unit in self.units:  # units some of whose parameters got no gradient
            if unit.gathered or unit.gathering:
                self._free_unit(unit)
            unit.backward_gathered = False

    # ----- step: the updated shard is all we keep -----------------------------------
    def _publish(self, g: GroupState) -> None:
        if self.mixed:
            g.shard.copy_(g.master)


class _Saved:
    """A tensor autograd saved from a unit's buffer, with the unit to gather first."""

    __slots__ = ("tensor", "unit")

    def __init__(self, tensor: torch.Tensor, unit: Unit):
        self.tensor, self.unit = tensor, unit


# Tensor methods and attributes that read no element (shape, dtype, hooks): allowed
# on any parameter, gathered or not (Hugging Face reads self.dtype from a parameter).
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "ndimension", "numel", "nelement", "__len__",
                       "stride", "storage_offset", "element_size", "is_floating_point", "is_complex",
                       "is_contiguous", "get_device", "data_ptr", "untyped_storage", "__hash__",
                       "requires_grad_", "register_hook", "register_post_accumulate_grad_hook"})


class _ReadGuard(TorchFunctionMode):
    """During a ZeRO-3 forward: no torch op may read a parameter whose unit is not gathered."""

    def __init__(self, engine: Zero3Engine):
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in _METADATA:
            for p in _parameters_in(args, kwargs):
                found = self.engine._param_unit.get(id(p))
                if found is not None and not found[1].gathered:
                    self.engine._refuse_read(*found)
        return func(*args, **kwargs)


def _parameters_in(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, nn.Parameter):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, nn.Parameter))


def _storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, the same before and after it is resized."""
    return t.untyped_storage()._cdata


def _default_units(model: nn.Module) -> list[nn.Module]:
    """The model's children, a ModuleList's or ModuleDict's items in its place."""
    out = []
    for child in model.children():
        out += list(child.children()) if isinstance(child, CONTAINERS) else [child]
    return out


def _tensors(output) -> list[torch.Tensor]:
    """The tensors in a unit's output: nested lists, tuples, dicts and dataclasses."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [t for f in dataclasses.fields(output) for t in _tensors(getattr(output, f.name))]
    return []
