"""What an engine's rank holds, measured, gathered and set: the engine's state API.

:class:`EngineStateMixin` is part of :class:`zerolearn.engines.base.Engine`; it only
reads and writes the buckets (``self.buckets``, :class:`~zerolearn.engines.base.Bucket`)
and the optimizer, so it is the same for every stage. Checkpoints
(:mod:`zerolearn.checkpoint`) save and load through these methods.
"""

from __future__ import annotations

import torch

from zerolearn import comm
from zerolearn.engines.optim import optimizer_state
from zerolearn.memory.ledger import storage_bytes


class EngineStateMixin:
    """Model states per category, bytes held, full fp32 parameters, loading shards.

    Expects the attributes an :class:`~zerolearn.engines.base.Engine` sets up:
    ``buckets``, ``optimizer``, ``device``, ``pg`` and ``_publish_all``.
    """

    @property
    def padding(self) -> int:
        """Zero elements added to make buckets divide into Nd equal shards (all buckets)."""
        return sum(b.layout.padding for b in self.buckets)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds as model states, by category (None: not held).

        ``params``: working parameters (full buffers, or shards under ZeRO-3);
        ``grads``: flat gradient buffers and shards; ``optimizer_states``: the fp32
        master (a storage of its own only in mixed precision) and the optimizer's
        per-element state (Adam's moments, SGD's momentum). Frozen parameters are not
        model states (Psi counts trainable ones).
        """
        return {"params": [t for b in self.buckets for t in (b.full, b.shard)],
                "grads": [t for b in self.buckets for t in (b.grad_full, b.grad_shard)],
                "optimizer_states": [t for b in self.buckets
                                     for t in [b.master, *optimizer_state(self.optimizer, b.master)]]}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now per category of :meth:`state_tensors`, measured
        from the tensors (each storage counted once, in the first category holding it)."""
        seen: set[int] = set()
        return {name: storage_bytes(tensors, seen) for name, tensors in self.state_tensors().items()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full and fp32, from the masters (a collective).

        Shapes as in the model; gathered with one all_gather per bucket when the master
        is sharded. Call on every rank.
        """
        out = {}
        for b in self.buckets:
            master = b.master.detach().float()
            if b.master.numel() != b.layout.padded_numel:
                full = torch.empty(b.layout.padded_numel, device=self.device)
                with comm.unit(b.layout.label, "full_state_dict: gather"):
                    comm.all_gather(full, master.contiguous(), group=self.pg)
                master = full
            for name, view in zip(b.layout.names, b.layout.views(master)):
                out[name] = view.clone()
        return out

    @torch.no_grad()
    def load_shards(self, masters: list[torch.Tensor], optimizer_state: dict) -> None:
        """Set every bucket's fp32 master and the optimizer's state, then republish.

        Args:
            masters: one fp32 tensor per bucket, shaped as ``b.master`` (this rank's
                shard, ``b.layout.shard_range`` of the bucket's flat buffer; the whole
                buffer at stage 0).
            optimizer_state: a ``torch.optim`` state dict for ``self.optimizer``.

        Republishing rebuilds the working parameters from the new masters (an
        all_gather per bucket at stages 1-2): a collective, call on every rank.
        """
        for b, m in zip(self.buckets, masters, strict=True):
            b.master.copy_(m)
        self._publish_all()
        self.optimizer.load_state_dict(optimizer_state)
