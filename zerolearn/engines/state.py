"""What an engine's rank holds, measured, gathered and set: the state API of every stage,
through which checkpoints (:mod:`zerolearn.checkpoint`) save and load; and the engine read as
the module it wraps (``engine.train()``, ``engine.state_dict()``, ..., as torch DDP's and FSDP's
wrappers answer), its parameters read or changed between steps inside
:meth:`ModuleView.summon_full_params` (stages 0-2: also in place, :meth:`Stepping._absorb_changes`)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerolearn import comm
from zerolearn.engines.optim import _fresh_state, optimizer_state
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import storage_bytes


class EngineStateMixin:
    """Model states per category, bytes held, full fp32 parameters, loading shards (mixed
    into :class:`~zerolearn.engines.base.Engine`, whose ``buckets``, ``optimizer``, ``device``,
    ``pg``, ``_publish_all`` and ``_offload`` it uses)."""

    LOCATIONS = ("device", "host", "disk")
    CATEGORIES = ("params", "grads", "optimizer_states")

    @property
    def padding(self) -> int:
        """Zero elements added to make buckets divide into Nd equal shards (all buckets)."""
        return sum(b.layout.padding for b in self.buckets)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds as model states, by category (None: not held): ``params``,
        working parameters (full, or shards under ZeRO-3); ``grads``, flat gradient buffers and
        shards (with offload, the host's fp32 ones too); ``optimizer_states``, the fp32 master (its
        own storage only in mixed precision) and the per-element state (Adam's moments, SGD's
        momentum). Frozen parameters are not model states (Psi, Sec 3.1)."""
        where = self.state_tensors_by_location()
        return {c: where["device"][c] + where["host"][c] for c in self.CATEGORIES}

    def state_tensors_by_location(self) -> dict[str, dict[str, list[torch.Tensor]]]:
        """:meth:`state_tensors` split into ``"device"`` and ``"host"`` (each by category).
        With offload (``"cpu"``, ``"disk"``, even on a CPU-only run) the master, moments and fp32
        gradient buffers are host tensors; under ``"disk"`` they hold no storage between steps."""
        device = {"params": [t for b in self.buckets for t in (b.full, b.shard)],
                  "grads": [t for b in self.buckets for t in (b.grad_full, b.grad_shard)]}
        if self._offload is None:
            device["optimizer_states"] = [t for b in self.buckets
                                          for t in [b.master, *optimizer_state(self._optimizer, b.master)]]
            return {"device": device, "host": {c: [] for c in self.CATEGORIES}}
        self._offload.wait()  # DPU: not while the host step changes them
        return {"device": {**device, "optimizer_states": []}, "host": self._offload.host_tensors(self)}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now per category of :meth:`state_tensors` (each storage counted
        once, in the first category holding it): device and host memory, not disk."""
        seen: set[int] = set()
        return {name: storage_bytes(tensors, seen) for name, tensors in self.state_tensors().items()}

    def model_state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds now, ``{"device" | "host" | "disk": {"params", "grads",
        "optimizer_states"}}``: memory from the tensors (each storage once), disk from the offload
        files' sizes. The paper's formulas: :func:`zerolearn.memory.model.offload_state_bytes`."""
        seen: set[int] = set()
        out = {loc: {c: storage_bytes(tensors, seen) for c, tensors in by_cat.items()}
               for loc, by_cat in self.state_tensors_by_location().items()}
        out["disk"] = self._offload.disk_bytes() if self._offload is not None else dict.fromkeys(self.CATEGORIES, 0)
        return out

    def offload_resident(self):
        """A context manager in which every bucket's fp32 master and optimizer states (stage 3:
        working shards too) are in host memory, no DPU step in flight: ``offload="disk"`` reads
        them, and writes back and releases them on exit; without offload, a no-op."""
        return contextlib.nullcontext() if self._offload is None else self._offload.resident(self)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full, fp32 and shaped as in the model, from the masters
        (one all_gather per sharded bucket: call on every rank). Under DPU the masters hold the
        last step's update; the working parameters show it after the next step or :meth:`finish_dpu`."""
        self._absorb_changes()  # parameters changed in place since the last step (stages 0-2)
        out = {}
        with self.offload_resident():
            for b in self.buckets:
                views = b.layout.views(self._whole(b, b.master, "full_state_dict: gather"))
                out.update(zip(b.layout.names, (view.clone() for view in views), strict=True))
        return out

    def _whole(self, b, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` (of bucket ``b``) fp32 on the device, all_gathered to the whole buffer if a shard."""
        t = t.detach().float().to(self.device)  # from the host, under offload
        if t.numel() != b.layout.padded_numel:
            whole = torch.empty(b.layout.padded_numel, device=self.device)
            with comm.unit(b.layout.label, what):
                comm.all_gather(whole, t.contiguous(), group=self.pg)
            t = whole
        return t

    @torch.no_grad()
    def load_shards(self, masters: list[torch.Tensor], optimizer_state: dict) -> None:
        """Set every bucket's fp32 master and the optimizer's state, then republish (an all_gather
        per bucket at stages 1-2: call on every rank); a DPU update in flight is replaced.

        Args:
            masters: one fp32 tensor per bucket, shaped as ``b.master``: this rank's shard,
                ``b.layout.shard_range`` of the flat buffer (stage 0: the whole buffer).
            optimizer_state: a ``torch.optim`` state dict for ``self.optimizer``.
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
        """Per parameter of bucket ``b``: ``(start, end)`` of its elements this rank's master holds,
        in the flattened parameter's coordinates, then in the master's (all 0: none)."""
        lo, hi = (0, b.layout.padded_numel) if b.master.numel() == b.layout.padded_numel else b.layout.shard_range
        out = []
        for p, off in zip(b.params, b.layout.offsets, strict=True):
            a, e = max(off, lo), min(off + p.numel(), hi)
            out.append((a - off, e - off, a - lo, e - lo) if a < e else (0, 0, 0, 0))
        return out

    def param_optimizer_state(self, p: torch.Tensor) -> dict:
        """``engine.optimizer.state[p]`` for a model parameter ``p``: this rank's part, as views of
        the master's state, shaped as ``p`` if whole, else 1-D (its elements of ``p.flatten()``);
        ``step`` counts the steps ``p`` took; ``{}`` if never stepped, as in torch.

        Raises:
            KeyError: ``p`` is not a trainable parameter of the model, or this rank holds none
                of its elements (ZeRO-1, 2, 3 shard the state), or no state yet (no step).
        """
        found = [(i, b, j) for i, b in enumerate(self.buckets) for j, q in enumerate(b.params) if q is p]
        if not found:
            raise KeyError("not a trainable parameter of the wrapped model (engine.optimizer.state holds the flat "
                           "masters and the model's trainable parameters)")
        i, b, j = found[0]
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

    @torch.no_grad()
    def full_optimizer_state_dict(self) -> dict:
        """``engine.optimizer.state_dict()``: the whole state as one torch optimizer over
        ``model.parameters()`` holds it (as torch's ``get_optimizer_state_dict(...,
        full_state_dict=True)`` for FSDP2), ``{"state": {k: {"step", "exp_avg", ...}},
        "param_groups": [{..., "params": [0, ..., N-1]}]}``, each tensor fp32 and shaped as
        parameter ``k``. One all_gather per sharded state tensor: call on every rank.
        """
        index = {id(p): k for k, p in enumerate(self.model.parameters())}
        state: dict[int, dict] = {}
        with self.offload_resident():
            for i, b in enumerate(self.buckets):
                master_state = self._optimizer.optimizers[i].state.get(b.master, {})
                full = {key: b.layout.views(self._whole(b, v, "optimizer state_dict: gather"))
                        for key, v in master_state.items() if torch.is_tensor(v) and v.dim() > 0}
                for j, p in enumerate(b.params):
                    steps = int(master_state["step"]) - b.skipped[j] if "step" in master_state else None
                    if not full or steps == 0:
                        continue  # torch holds no state for a parameter never stepped
                    step = {} if steps is None else {"step": torch.tensor(float(steps))}
                    state[index[id(p)]] = {**step, **{key: views[j].clone() for key, views in full.items()}}
        group = {k: v for k, v in self._optimizer.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(index)))}]}

    @torch.no_grad()
    def load_full_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`full_optimizer_state_dict`'s layout (from an engine of any stage, world size
        and bucket size, or a torch optimizer over ``model.parameters()`` or its trainable ones);
        each rank keeps its part. Hyperparameters come from the state dict's group, as in torch.

        Raises:
            ConfigError: indices that do not match the model's parameters; param groups with
                different hyperparameters; a state for a frozen parameter or of the wrong size.
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
        opt = self._optimizer.optimizers[i]
        master_state = opt.state[b.master]
        master_state.update(_fresh_state(opt, b.master) if not master_state else {})
        keys = {k for st in states for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        master_state.update({key: torch.zeros_like(b.master) for key in keys - master_state.keys()})
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


class ModuleView:
    """The wrapped model's face of the engine (mixed into :class:`zerolearn.engines.base.Engine`)."""

    @property
    def module(self) -> nn.Module:
        """The wrapped model (torch DDP's and FSDP's name for it)."""
        return self.model

    @property
    def training(self) -> bool:
        """The model's ``training`` flag."""
        return self.model.training

    def train(self, mode: bool = True):
        """``model.train(mode)`` (dropout on, BatchNorm updates its statistics); returns the engine."""
        self.model.train(mode)
        return self

    def eval(self):
        """``model.eval()``; returns the engine."""
        return self.train(False)

    def named_parameters(self, *args, **kwargs):
        """The model's ``named_parameters``; at ZeRO-3 valued only inside :meth:`summon_full_params`."""
        return self.model.named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        """The model's ``parameters`` (see :meth:`named_parameters`)."""
        return self.model.parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        """The model's ``named_buffers``."""
        return self.model.named_buffers(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        """The model's ``buffers``."""
        return self.model.buffers(*args, **kwargs)

    def modules(self):
        """The model's ``modules()``: the model first (torch DDP's wrapper lists itself first)."""
        return self.model.modules()

    def named_modules(self, *args, **kwargs):
        """The model's ``named_modules``."""
        return self.model.named_modules(*args, **kwargs)

    def children(self):
        """The model's ``children()``."""
        return self.model.children()

    def apply(self, fn):
        """``model.apply(fn)`` (every module, children first); returns the engine."""
        self.model.apply(fn)
        return self

    def to(self, *args, **kwargs):
        """``engine.to(device)`` on the model's device (and dtype) returns the engine, as torch
        DDP's wrapper does after ``model.to``.

        Raises:
            ConfigError: another device or dtype (the buffers stay where the model was wrapped).
        """
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if (device is not None and torch.device(device).type != self.device.type) or \
                (dtype is not None and dtype != self.dtype):
            raise ConfigError(f"engine.to({', '.join(map(repr, args))}): the engine holds its buffers on "
                              f"{self.device} in {str(self.dtype).removeprefix('torch.')}; move or cast the model "
                              "before wrapping it (model.to(device), then the engine)")
        return self

    def state_dict(self, *args, **kwargs) -> dict:
        """The model's ``state_dict`` in the working dtype: at stages 0-2 the model's own (sharing
        the parameters' memory); at ZeRO-3 copies gathered inside :meth:`summon_full_params` (call
        on every rank). :meth:`full_state_dict` gives the fp32 masters."""
        if self.stage != 3:
            return self.model.state_dict(*args, **kwargs)
        with self.summon_full_params(writeback=False):
            return {k: v.detach().clone() if torch.is_tensor(v) else v
                    for k, v in self.model.state_dict(*args, **kwargs).items()}

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True):
        """A block in which every trainable parameter holds its full working values, to read or
        change between steps, as FSDP's ``summon_full_params``. At ZeRO-3 they are gathered on
        entry (an all_gather per bucket: call on every rank) and freed on exit. With
        ``writeback``, elements changed inside become the fp32 master's (and ZeRO-3 shard's)
        values on exit: make the same change on every rank. A DPU update in flight lands first.

        Raises:
            ConfigError: (on entry) a parameter replaced or cast since wrapping
                (:class:`zerolearn.engines.bindings.Bindings`).
        """
        self._bindings.check("summon_full_params block")
        self.finish_dpu()
        self._summon()
        try:
            yield
        finally:
            try:
                if writeback:
                    with torch.no_grad(), self.offload_resident():
                        for b in self.buckets:
                            self._write_back(b)
            finally:
                self._unsummon()
                self._versions = self._full_versions()

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """``model.load_state_dict(state_dict, strict)`` inside :meth:`summon_full_params` (at
        ZeRO-3 call on every rank with the same dict); the optimizer's state is kept
        (:mod:`zerolearn.checkpoint` restores both). Returns ``(missing_keys, unexpected_keys)``."""
        with self.summon_full_params():
            return self.model.load_state_dict(state_dict, strict=strict)

    def _summon(self) -> None:
        """Make every parameter hold its full values (stages 0-2: they do)."""

    def _unsummon(self) -> None:
        """Undo :meth:`_summon`."""

    def _write_back(self, b) -> None:
        """Elements of ``b``'s working parameters that differ from the master (rounded) become its."""
        work = b.full if b.master.numel() == b.layout.padded_numel else b.layout.shard_of(b.full)
        if b.shard is not None:  # ZeRO-3 keeps a working shard (in fp32 without offload, the master)
            work = b.shard.copy_(work)
        master = b.master.data
        if work.untyped_storage()._cdata == master.untyped_storage()._cdata:
            return  # the master is the working buffer (fp32 stage 0) or the shard itself
        work = work.to(master.device)
        changed = work != master.to(work.dtype)
        master[changed] = work[changed].to(master.dtype)  # no element changed: writes nothing
