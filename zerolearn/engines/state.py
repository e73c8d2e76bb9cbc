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
from zerolearn.errors import ConfigError
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
            for name, view in zip(b.layout.names, b.layout.views(master), strict=True):
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

    # ----- the optimizer's state as torch's, keyed by the model's parameters -------------------
    def _held_ranges(self, b) -> list[tuple[int, int, int, int]]:
        """Per parameter of bucket ``b``: ``(start, end)`` of the elements of it this rank's
        master holds, in the parameter's flattened coordinates, then the same elements in the
        master's (``start == end``: none of it)."""
        whole = b.master.numel() == b.layout.padded_numel
        lo, hi = (0, b.layout.padded_numel) if whole else b.layout.shard_range
        out = []
        for p, off in zip(b.params, b.layout.offsets, strict=True):
            a, e = max(off, lo), min(off + p.numel(), hi)
            out.append((a - off, e - off, a - lo, e - lo) if a < e else (0, 0, 0, 0))
        return out

    def param_optimizer_state(self, p: torch.Tensor) -> dict:
        """``engine.optimizer.state[p]`` for a model parameter ``p``: the part of its optimizer
        state this rank holds, as views of the master's state (writes reach the optimizer).

        Tensors are shaped as ``p`` where this rank holds all of ``p`` (stage 0, or a shard
        that covers it), else 1-D: the elements of ``p.flatten()`` in this rank's shard.
        ``step`` is the number of steps ``p`` took (a parameter no rank used sat out some).

        Raises:
            KeyError: ``p`` is not a trainable parameter of the model, or this rank holds
                none of its elements (ZeRO-1, 2 and 3 shard the state over the ranks), or
                it has no state yet (before the first step). A parameter that has not yet
                been stepped (Adam) gives ``{}``, as torch's ``optimizer.state[p]`` does.
        """
        for i, b in enumerate(self.buckets):
            for j, q in enumerate(b.params):
                if q is not p:
                    continue
                a, e, ma, me = self._held_ranges(b)[j]
                state = self._optimizer.optimizers[i].state.get(b.master)
                if a == e or not state:
                    raise KeyError(f"{b.layout.names[j]}: this rank (rank {self.rank}) holds "
                                   f"{'none of its optimizer state' if a == e else 'no optimizer state yet'}")
                if "step" in state and int(state["step"]) == b.skipped[j]:
                    return {}  # never stepped: torch's state for it is empty too
                whole = e - a == p.numel()
                out = {k: (v[ma:me].view(p.shape) if whole else v[ma:me])
                       for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
                if "step" in state:
                    out["step"] = state["step"] - b.skipped[j]
                return out
        raise KeyError("not a trainable parameter of the wrapped model (engine.optimizer.state holds the flat "
                       "masters and the model's trainable parameters)")

    @torch.no_grad()
    def full_optimizer_state_dict(self) -> dict:
        """The optimizer's whole state as one torch optimizer over ``model.parameters()``
        would hold it: ``{"state": {k: {"step", "exp_avg", ...}}, "param_groups": [{...,
        "params": [0, ..., N-1]}]}``, ``k`` the index in ``list(model.parameters())``, each
        tensor fp32 and shaped as its parameter (gathered: one all_gather per bucket and
        state tensor where the state is sharded). A collective: call on every rank. What
        ``engine.optimizer.state_dict()`` returns; it loads into a plain torch optimizer
        over the same model, or an engine of any stage, world size and bucket size
        (:meth:`load_full_optimizer_state_dict`), as torch's
        ``get_optimizer_state_dict(..., full_state_dict=True)`` does for FSDP2.
        """
        index = {id(p): k for k, p in enumerate(self.model.parameters())}
        state: dict[int, dict] = {}
        with self.offload_resident():
            for i, b in enumerate(self.buckets):
                master_state = self._optimizer.optimizers[i].state.get(b.master, {})
                full = {}
                for key, v in master_state.items():
                    if not (torch.is_tensor(v) and v.dim() > 0):
                        continue
                    v = v.detach().float().to(self.device)
                    if v.numel() != b.layout.padded_numel:
                        whole = torch.empty(b.layout.padded_numel, device=self.device)
                        with comm.unit(b.layout.label, "optimizer state_dict: gather"):
                            comm.all_gather(whole, v.contiguous(), group=self.pg)
                        v = whole
                    full[key] = b.layout.views(v)
                for j, p in enumerate(b.params):
                    steps = int(master_state["step"]) - b.skipped[j] if "step" in master_state else None
                    if not full or steps == 0:
                        continue  # torch holds no state for a parameter never stepped
                    st = {key: views[j].clone() for key, views in full.items()}
                    if steps is not None:
                        st = {"step": torch.tensor(float(steps)), **st}
                    state[index[id(p)]] = st
        group = {k: v for k, v in self._optimizer.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(index)))}]}

    @torch.no_grad()
    def load_full_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`full_optimizer_state_dict`'s layout: from this engine or another (any
        stage, world size, bucket size) or from a plain torch optimizer of the same kind over
        ``model.parameters()`` (or over its trainable parameters only), same order. Each rank
        keeps its part. Hyperparameters come from the state dict's group, as in torch.

        Raises:
            ConfigError: the indices do not match the model's parameters; several param
                groups with different hyperparameters; a state for a frozen parameter; a
                tensor of the wrong number of elements.
        """
        groups = state_dict["param_groups"]
        ids = sorted(int(k) for g in groups for k in g["params"])
        everyone = list(self.model.parameters())
        trainable = [p for p in everyone if p.requires_grad]
        order = everyone if ids == list(range(len(everyone))) else trainable
        if ids != list(range(len(order))):
            raise ConfigError(f"optimizer state dict over {len(ids)} parameters: the model has {len(everyone)} "
                              f"({len(trainable)} trainable); load the state of an optimizer over "
                              "model.parameters(), in the same order")
        hyper = [{k: v for k, v in g.items() if k not in ("params", "foreach", "fused", "capturable")} for g in groups]
        if any(h != hyper[0] for h in hyper):
            raise ConfigError("optimizer state dict with param groups of different hyperparameters: the engine "
                              "trains every parameter with one group")
        by_param = {id(order[int(k)]): v for k, v in state_dict["state"].items()}
        owned = {id(p) for b in self.buckets for p in b.params}
        frozen = [k for k, p in enumerate(order) if id(p) in by_param and id(p) not in owned]
        if frozen:
            raise ConfigError(f"optimizer state for parameter {frozen[0]}, which the engine does not train "
                              "(requires_grad=False)")
        self._optimizer.param_groups[0].update(hyper[0])
        self._optimizer.push_hyperparameters()
        with self.offload_resident():
            for i, b in enumerate(self.buckets):
                self._load_bucket_state(i, b, [by_param.get(id(p), {}) for p in b.params])
            if self._offload is not None:
                self._offload.loaded(self)
        self._optimizer._multi = None

    def _load_bucket_state(self, i: int, b, states: list[dict]) -> None:
        """Master ``i``'s state from its parameters' (``states``, torch's per-parameter dicts)."""
        from zerolearn.engines.optim import _fresh_state

        opt = self._optimizer.optimizers[i]
        master_state = opt.state[b.master]
        master_state.update(_fresh_state(opt, b.master) if not master_state else {})
        keys = {k for st in states for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        for key in keys - master_state.keys():
            master_state[key] = torch.zeros_like(b.master)
        for key in keys:
            for j, (st, (a, e, ma, me)) in enumerate(zip(states, self._held_ranges(b), strict=True)):
                v = st.get(key)
                if v is not None and v.numel() != b.params[j].numel():
                    raise ConfigError(f"optimizer state {key} of {b.layout.names[j]}: {v.numel()} elements, the "
                                      f"parameter has {b.params[j].numel()}")
                if a < e:
                    part = master_state[key][ma:me]
                    part.copy_(v.reshape(-1)[a:e]) if v is not None else part.zero_()
        if "step" in master_state:
            steps = [int(st["step"]) if "step" in st else 0 for st in states]
            master_state["step"].fill_(max(steps))
            b.skipped = [max(steps) - s for s in steps]
