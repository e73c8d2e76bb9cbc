"""What an engine keeps for one flat group: buffers, master shard, gradients.

The layout (:class:`zerolearn.flat.FlatLayout`) says where things are and never
changes; this says what a rank holds there now. Which fields a stage fills is the
whole difference between the stages (Sec 5, Fig 1):

=========  ===============  ===============  ================  ===============
stage      ``full``         ``shard``        ``grad_full``     ``grad_shard``
=========  ===============  ===============  ================  ===============
0 (DP)     kept             -                kept              -
1 (P_os)   kept             -                kept              while accumulating
2 (+g)     kept             -                until reduced     kept
3 (+p)     gathered in use  kept             until reduced     kept
=========  ===============  ===============  ================  ===============

``master`` (the fp32 tensor the optimizer steps) is the whole buffer at stage 0 and
this rank's shard at stages 1-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zerolearn import comm
from zerolearn.flat import FlatLayout


class GradTally:
    """Gradient bytes an engine's groups hold now (``held``), kept up to date by
    :class:`GroupState` whenever a group's ``grad_full`` or ``grad_shard`` is set.

    So reading the total costs O(1), not a walk over every group's storages: the
    engine reads it after each gradient allocation (``peak_grad_bytes``), and a walk
    there would cost O(G^2) per step for G groups.
    """

    def __init__(self) -> None:
        self.held = 0


def _storage_bytes(*tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@dataclass(eq=False)
class GroupState:
    """One flat group's tensors on this rank; ``None`` means not held now.

    Attributes:
        layout: the group's fixed layout (names, offsets, this rank's shard range).
        params: the model's parameters in buffer order; their ``.data`` are views of
            ``full`` (:meth:`FlatLayout.bind`).
        full: working parameters, (``padded_numel``,) in the working dtype; under
            ZeRO-3 its storage is resized to 0 bytes between uses.
        shard: working-parameter shard, (``shard_numel``,), ZeRO-3 only.
        master: the fp32 tensor the optimizer steps: (``padded_numel``,) at stage 0,
            (``shard_numel``,) otherwise. In fp32 it may share storage with
            ``full`` or ``shard`` (one tensor, K = 8 for Adam).
        grad_full: this backward's gradient of the whole group, before reduction.
        grad_shard: the reduced (averaged) gradient of this rank's shard.
        reduced: a reduction's output when it cannot go straight into ``grad_shard``
            (stage 1 always; stages 2-3 while accumulating onto an earlier backward).
        reducing: the reduction in flight (launched, not finished), or None.
        ready: parameters whose gradient has arrived in this backward.
        used: per parameter, whether it got a gradient on this rank since the last
            ``zero_grad`` (torch's ``.grad is not None``).
        skipped: per parameter, optimizer steps it sat out because no rank used it
            (so its Adam step count is the group's minus this).
        tally: the engine's :class:`GradTally`, told the change in this group's
            gradient bytes whenever ``grad_full`` or ``grad_shard`` is set (None: not tallied).
    """

    layout: FlatLayout
    params: list[nn.Parameter]
    full: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    master: nn.Parameter | None = None
    grad_full: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    reduced: torch.Tensor | None = None
    reducing: comm.Handle | None = field(default=None, repr=False)
    ready: int = 0
    used: list[bool] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    tally: GradTally | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.used = [False] * len(self.params)
        self.skipped = [0] * len(self.params)

    def __setattr__(self, name: str, value) -> None:
        tally = self.__dict__.get("tally")
        if tally is None or name not in ("grad_full", "grad_shard"):
            object.__setattr__(self, name, value)
            return
        before = _storage_bytes(self.grad_full, self.grad_shard)
        object.__setattr__(self, name, value)
        tally.held += _storage_bytes(self.grad_full, self.grad_shard) - before

    @property
    def complete(self) -> bool:
        """Every parameter of the group has its gradient in ``grad_full``."""
        return self.ready == len(self.params)
