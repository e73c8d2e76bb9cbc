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
trade for a tied weight that is used far apart). A parameter read *outside* its
unit's forward (``F.linear(h, self.emb.weight)`` in the parent's forward) is already
freed there: that fails with a ConfigError naming the parameter, its unit and the fix.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from zerolearn import comm
from zerolearn.dist import ConfigError
from zerolearn.engines.group import GroupState
from zerolearn.engines.zero2 import Zero2Engine


class Unit:
    """A module whose flat groups are gathered and freed together.

    Attributes:
        index: position in the unit list (the root unit, the model, comes last).
        name: the module's name in the model (``blocks.1``; ``<model>`` for the root),
            for messages and debug-mode fingerprints.
    """

    def __init__(self, index: int, name: str, module: nn.Module, groups: list[GroupState]):
        self.index, self.name, self.module, self.groups = index, name, module, groups
        self.gathering: list[comm.Handle] = []  # all_gathers in flight
        self.gathered = False
        self.backward_gathered = False  # pre-backward already ran in this backward


def _free(g: GroupState) -> None:
    g.full.untyped_storage().resize_(0)


class Zero3Engine(Zero2Engine):
    """Stage 3 (P_os+g+p): sharded params, grads and optimizer states; per-unit gather.

    Memory per rank (bytes): (2 + 2 + K) Psi / Nd (+ padding) between units, plus
    at most about two gathered units during forward and backward.
    Traffic per step: all_gather 2 Psi + reduce_scatter Psi elements.

    Raises:
        ConfigError: (in forward) the model read a unit's parameter after that unit's
            forward had freed it.
    """

    stage = 3
    peak_gathered_bytes = 0  # most bytes of gathered (full) parameters alive at once

    # ----- layout: groups never cross a unit boundary ------------------------------
    def _build_groups(self, trainable, units) -> list[GroupState]:
        if units is None:
            units = self.model.units() if hasattr(self.model, "units") else list(self.model.children())
        # Parameters outside every unit, and parameters shared by several units (tied
        # weights), form a last unit, the root, around the whole model.
        root = len(units)
        owner: dict[int, int] = {}
        for u, module in enumerate(units):
            for p in module.parameters():
                owner[id(p)] = root if owner.get(id(p), u) != u else u
        modules = [*units, self.model]
        names = {id(m): name or "<model>" for name, m in self.model.named_modules()}
        per_unit: list[list] = [[] for _ in modules]
        for name, p in trainable:
            per_unit[owner.get(id(p), len(units))].append((name, p))
        self.units, groups = [], []
        for u in reversed(range(len(modules))):  # backward order, as in the base class
            if not per_unit[u]:
                continue
            unit_groups = self._groups_of(per_unit[u][::-1])
            self.units.append(Unit(u, names.get(id(modules[u]), type(modules[u]).__name__), modules[u], unit_groups))
            groups += unit_groups
        self.units.sort(key=lambda unit: unit.index)  # forward order
        self._unit_of = {id(g): unit for unit in self.units for g in unit.groups}
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
        _free(g)

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if "storage of size 0" not in str(e):
                raise
            raise ConfigError(self._used_while_freed(str(e))) from e

    def _used_while_freed(self, message: str) -> str:
        # torch names the shape of the view it could not read (a weight, or its
        # transpose): match its size to the freed parameters.
        m = re.search(r"sizes \[([\d, ]*)\]", message)
        numel = math.prod(int(s) for s in m.group(1).split(",") if s.strip()) if m else None
        suspects = [(name, unit) for unit in self.units for g in unit.groups
                    for name, p in zip(g.layout.names, g.params)
                    if g.full.untyped_storage().nbytes() == 0 and numel in (None, p.numel())]
        named = ", ".join(f"{name} (unit {unit.index}: {type(unit.module).__name__})" for name, unit in suspects[:4])
        return (f"ZeRO-3: the model read parameter {named or 'of a freed unit'} after that unit's forward had "
                "returned and its gathered parameters were freed (for example F.linear(h, self.emb.weight) in "
                "the parent's forward). Tie through modules instead (lm_head.weight = emb.weight: shared "
                "parameters stay gathered in the root unit), or pass units= so that the module that reads the "
                "parameter and the module that owns it are in one unit.")

    # ----- gather / free -------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered or unit.gathering:
            return
        for g in unit.groups:
            g.full.untyped_storage().resize_(g.layout.padded_numel * g.full.element_size())
            self._track_buffer(g.full)
            unit.gathering.append(comm.all_gather(g.full, g.shard, group=self.pg, async_op=True))
        gathered = sum(g.full.untyped_storage().nbytes() for g in self.groups)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    def _gather(self, unit: Unit) -> None:
        self._start_gather(unit)
        for handle in unit.gathering:
            handle.wait()
        unit.gathering.clear()
        unit.gathered = True

    def _free_unit(self, unit: Unit) -> None:
        for handle in unit.gathering:  # a prefetch nobody used
            handle.wait()
        unit.gathering.clear()
        for g in unit.groups:
            _free(g)
        unit.gathered = False

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        i = self.units.index(unit) + step
        return self.units[i] if 0 <= i < len(self.units) else None

    def _pre_forward(self, unit: Unit) -> None:
        with comm.unit(unit.name, "forward: gather"):  # names this unit in debug mode
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
            # before autograd enters this unit's backward: gather it again there.
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
        _free(g)
        unit = self._unit_of[id(g)]
        if all(other.complete for other in unit.groups):
            self._free_unit(unit)
        super()._on_group_ready(g)

    def _after_backward(self) -> None:
        for unit in self.units:  # units some of whose parameters got no gradient
            if unit.gathered or unit.gathering:
                self._free_unit(unit)
            unit.backward_gathered = False

    # ----- step: the updated shard is all we keep -----------------------------------
    def _publish(self, g: GroupState) -> None:
        if self.mixed:
            g.shard.copy_(g.master)


def _tensors(output):
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
