"""What an engine's rank holds, measured, gathered and set: the engine's state API.

:class:`EngineStateMixin` is part of :class:`zerolearn.engines.base.Engine`; it only
reads and writes the buckets (``self.buckets``, :class:`~zerolearn.engines.base.Bucket`)
and the optimizer, so it is the same for every stage. Checkpoints
(:mod:`zerolearn.checkpoint`) save and load through these methods.
"""

from __future__ import annotations

import contextlib

import torch

from zerolearn import comm
from zerolearn.engines.optim import optimizer_state
from zerolearn.memory.ledger import storage_bytes


class EngineStateMixin:
    """Model states per category, bytes held, full fp32 parameters, loading shards.

    Expects the attributes an :class:`~zerolearn.engines.base.Engine` sets up:
    ``buckets``, ``optimizer``, ``device``, ``pg``, ``_publish_all`` and ``_offload``
    (:class:`zerolearn.engines.offload.Offload` or None).
    """

    LOCATIONS = ("device", "host", "disk")
    CATEGORIES = ("params", "grads", "optimizer_states")

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
        model states (Psi counts trainable ones). With offload, the host's fp32 gradient
        buffers are ``grads`` too, and the master and moments live on the host.
        """
        where = self.state_tensors_by_location()
        return {c: where["device"][c] + where["host"][c] for c in self.CATEGORIES}

    def state_tensors_by_location(self) -> dict[str, dict[str, list[torch.Tensor]]]:
        """:meth:`state_tensors` split into ``"device"`` and ``"host"`` (each by category).

        Without offload everything is on the device. With offload (``offload="cpu"`` or
        ``"disk"``) the master, the moments and the fp32 gradient buffers are host tensors
        of their own, on a CPU-only run too, where device and host are the same memory.
        Under ``"disk"`` the host's optimizer states hold no storage between steps.
        """
        device = {"params": [t for b in self.buckets for t in (b.full, b.shard)],
                  "grads": [t for b in self.buckets for t in (b.grad_full, b.grad_shard)]}
        if self._offload is None:
            device["optimizer_states"] = [t for b in self.buckets
                                          for t in [b.master, *optimizer_state(self._optimizer, b.master)]]
            return {"device": device, "host": {c: [] for c in self.CATEGORIES}}
        self._offload.wait()  # DPU: not while the host step changes them
        device["optimizer_states"] = []
        return {"device": device, "host": self._offload.host_tensors(self)}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now per category of :meth:`state_tensors`, measured
        from the tensors (each storage counted once, in the first category holding it):
        device and host memory together, disk not included."""
        seen: set[int] = set()
        return {name: storage_bytes(tensors, seen) for name, tensors in self.state_tensors().items()}

    def model_state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds now, ``{"device" | "host" | "disk": {"params", "grads",
        "optimizer_states"}}``: memory measured from the tensors held (each storage counted
        once), disk from the sizes of the offload files (``offload="disk"``).

        For the paper's formulas extended to offload, see
        :func:`zerolearn.memory.model.offload_state_bytes`.
        """
        seen: set[int] = set()
        out = {loc: {c: storage_bytes(tensors, seen) for c, tensors in by_cat.items()}
               for loc, by_cat in self.state_tensors_by_location().items()}
        out["disk"] = (self._offload.disk_bytes() if self._offload is not None
                       else {"params": 0, "grads": 0, "optimizer_states": 0})
        return out

    def offload_resident(self):
        """A context manager: inside it every bucket's fp32 master and optimizer states are in
        host memory (``offload="disk"`` reads them all, and writes them back and releases
        them on exit; at stage 3 the working parameter shards too), and no DPU step is in
        flight. Wrap any direct read of ``b.master``, ``b.shard`` or ``optimizer.state``
        under disk offload in it (a checkpoint's save does so itself). Without offload it
        does nothing."""
        if self._offload is None:
            return contextlib.nullcontext()
        return self._offload.resident(self)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full and fp32, from the masters (a collective).

        Shapes as in the model; gathered with one all_gather per bucket when the master
        is sharded. Call on every rank. Under DPU the masters hold the update of the
        last step (waited for), which the working parameters show after the next step or
        :meth:`finish_dpu`.
        """
        self._absorb_changes()  # parameters changed in place since the last step (stages 0-2)
        with self.offload_resident():
            return self._gather_masters()

    def _gather_masters(self) -> dict[str, torch.Tensor]:
        out = {}
        for b in self.buckets:
            master = b.master.detach().float().to(self.device)  # from the host, under offload
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
        all_gather per bucket at stages 1-2): a collective, call on every rank. Under
        DPU the update in flight is waited for and replaced by the loaded state.
        """
        with self.offload_resident():
            for b, m in zip(self.buckets, masters, strict=True):
                b.master.copy_(m)
            self._publish_all()
            self.optimizer.load_state_dict(optimizer_state)
            if self._offload is not None:
                self._offload.loaded(self)
