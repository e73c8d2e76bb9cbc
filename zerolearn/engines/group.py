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

    @property
    def complete(self) -> bool:
        """Every parameter of the group has its gradient in ``grad_full``."""
        return self.ready == len(self.params)
