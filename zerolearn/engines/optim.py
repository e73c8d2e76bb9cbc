"""What an engine's step needs besides collectives: the optimizer, clipping, bytes held.

torch's own optimizer, one per flat fp32 master (:class:`GroupedOptimizer`; a master per bucket: the whole buffer at
stage 0, this rank's shard at stages 1-3). Adam and SGD are element-wise, so stepping flat shards gives the numbers of
stepping the original tensors: what lets ZeRO shard them freely (Sec 5.1).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from zerolearn.errors import ConfigError, require_choice, require_real

OPTIMIZERS = ("adam", "adamw", "sgd")
# Elements of a master stepped at once on the CPU (512 KiB of fp32): chunk by chunk the master, its gradient and
# moments stay in the cache through torch's ~10 element-wise ops (Adam on 7.3M elements, one thread: 36 -> 19 ms).
CPU_CHUNK = 1 << 17


def check_options(optimizer: str, lr: float, bucket_mb: float | None, max_grad_norm: float | None) -> None:
    """Refuse bad engine options before anything is allocated or communicated.

    Raises:
        ConfigError: naming the option (as the CLI spells it) and what is allowed.
    """
    require_choice("--optimizer", optimizer, OPTIMIZERS)
    require_real("--lr", lr, strict=False)  # lr=0 is torch's too (a warm-up's first step)
    if bucket_mb is not None:
        require_real("--bucket-mb", bucket_mb)
    if max_grad_norm is not None:
        require_real("--max-grad-norm", max_grad_norm)


# torch's options the engine passes on, per optimizer: element-wise, so exact in chunks or per parameter range.
OPTIONS = {"sgd": ("nesterov", "maximize"), "adam": ("eps", "amsgrad", "maximize"),
           "adamw": ("eps", "amsgrad", "maximize")}
# What the engine decides itself (how the step runs), or cannot make exact.
_REFUSED = {
    "dampening": "SGD's dampening: torch starts the momentum buffer as a clone of the first gradient, undamped, and "
                 "the engine creates that buffer itself where it steps a master in chunks or a parameter that sat "
                 "out a step, where a dampened first update would differ; dampening=0 only",
    "differentiable": "differentiable=True: the engine's step runs under no_grad on flat masters",
    **{k: f"{k}=: the engine chooses how its masters are stepped (fused on CUDA)"
       for k in ("foreach", "fused", "capturable")},
}


def check_optimizer_kwargs(name: str, kwargs: dict) -> None:
    """Refuse, by name, an option of torch's optimizer the engine cannot make exact.

    Raises:
        ConfigError: an option not in :data:`OPTIONS` for ``name`` (listing those allowed), or one of the refused ones
            (``dampening`` other than 0, ``differentiable``, ``foreach``, ``fused``, ``capturable``) with the reason.
    """
    for key, value in kwargs.items():
        if key == "dampening" and value == 0:
            continue
        if key in _REFUSED:
            raise ConfigError(f"optimizer_kwargs {key}={value!r}: {_REFUSED[key]}")
        if key not in OPTIONS[name]:
            raise ConfigError(f"optimizer_kwargs {key}={value!r}: allowed for {name} are "
                              f"{', '.join(OPTIONS[name])} (lr, weight_decay, momentum, betas are the engine's own "
                              "options)")


def multi_tensor_kind(device: torch.device) -> str | None:
    """How an engine steps all of a rank's masters at once on ``device``: ``"fused"`` on CUDA (``"foreach"`` is accepted
    too, for tests), else None. Fused (torch's ``_fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_``) launches one
    kernel per group where the per-tensor loop launches ~10 per master, and takes the overflow flag (``found_inf``) with
    Adam's step count on the device, so a skipped step reads nothing on the host. On the CPU one master at a time
    (:meth:`GroupedOptimizer.step_bucket`, :data:`CPU_CHUNK` elements at a time) beats one pass of each op over all.
    """
    return "fused" if device.type == "cuda" else None


def make_optimizer(name: str, params: list[nn.Parameter], lr: float, weight_decay: float = 0.0,
                   momentum: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                   kind: str | None = None, options: dict | None = None) -> torch.optim.Optimizer:
    """torch's own Adam / AdamW / SGD over the flat master tensors (``params``): one ``step()`` updates every master
    with a ``.grad``, on the CPU each on its own (torch's per-tensor loop), bit-identical however many one call covers.

    Args:
        kind: None (torch's default for the device), ``"fused"`` or ``"foreach"`` (:func:`multi_tensor_kind`).
        options: more of torch's options (:data:`OPTIONS`, checked by :func:`check_optimizer_kwargs`).

    Raises:
        ConfigError: ``name`` is not one of :data:`OPTIMIZERS`.
    """
    require_choice("--optimizer", name, OPTIMIZERS)
    extra = {**(options or {}), **({kind: True} if kind is not None else {})}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **extra)
    adam = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return adam(params, lr=lr, betas=betas, weight_decay=weight_decay, **extra)


class _StateView(Mapping):
    """``GroupedOptimizer.state``: master -> its optimizer's state; a model parameter of the bound engine -> this
    rank's part of its state (:meth:`~zerolearn.engines.state.EngineStateMixin.param_optimizer_state`)."""

    def __init__(self, owner: GroupedOptimizer):
        self._owner = owner

    def __getitem__(self, key: torch.Tensor) -> dict:
        i = self._owner.index.get(id(key))
        if i is not None and key is self._owner.masters[i] and key in self._owner.optimizers[i].state:
            return self._owner.optimizers[i].state[key]
        engine = self._owner._engine() if self._owner._engine is not None else None
        if i is None and engine is not None:
            return engine.param_optimizer_state(key)
        raise KeyError("no optimizer state for this tensor")

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (m for o in self._owner.optimizers for m in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._owner.optimizers)


class GroupedOptimizer(torch.optim.Optimizer):
    """One torch optimizer per flat master, seen from outside as one torch optimizer over them.

    The engine steps one bucket at a time (in mixed precision only one bucket's fp32 gradient may exist at once; the
    paper's (2 + 2 + K) Psi holds none): one torch optimizer over all G masters would walk all of them on every
    ``step()``, O(G^2) Python work per engine step, where :meth:`step_bucket` touches its master alone, O(G).
    :meth:`step_all` steps every master in one multi-tensor call (:attr:`multi`) over the same per-master state.

    Outside it has one param group over the masters in bucket order: torch's LR schedulers accept it, and a change to
    ``param_groups[0]`` reaches every bucket's optimizer at the next step. ``state``, :meth:`state_dict` and
    :meth:`load_state_dict` use a single torch optimizer's layout (params 0..G-1). Bound to an engine (:meth:`bind`),
    :meth:`step` (which ``engine.step()`` calls) and :meth:`zero_grad` are the engine's, so a loop written for a torch
    optimizer trains exactly as ``engine.step()`` does.

    Args:
        optimizers: one torch optimizer per master, over it alone (one param group, the same hyperparameters).
        masters: the flat fp32 masters, in bucket order.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], masters: list[torch.Tensor]):
        self.optimizers, self.masters = optimizers, masters
        self.multi = multi_tensor_kind(masters[0].device) if masters else None  # how step_all steps
        self._multi: torch.optim.Optimizer | None = None  # built by step_all, sharing the masters' state
        self.index = {id(m): i for i, m in enumerate(masters)}
        self._engine = None  # a weak reference to the engine whose step this is (bind)
        self.stepped: bool | None = None  # what the engine's last step returned
        hyper = {k: v for k, v in optimizers[0].param_groups[0].items() if k != "params"} if optimizers else {}
        super().__init__(list(masters), dict(hyper))
        self._pushed = dict(hyper)  # the hyperparameters the per-master optimizers hold now

    def bind(self, engine) -> None:
        """Make :meth:`step` and :meth:`zero_grad` the engine's (held by weak reference)."""
        self._engine = weakref.ref(engine)

    # Read through the per-master optimizers: the ``state`` torch's __init__ assigns is dropped.
    @property
    def state(self) -> Mapping:
        """master -> its state (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``), as in torch."""
        return _StateView(self)

    @state.setter
    def state(self, value) -> None:
        if value:
            raise ConfigError("GroupedOptimizer.state is read through each bucket's optimizer; load a state "
                              "with load_state_dict(...) instead of assigning it")

    def add_param_group(self, param_group: dict) -> None:
        """Torch's ``add_param_group``: only the one group of the engine's masters.

        Raises:
            ConfigError: a second group (the engine trains every parameter with one set of hyperparameters).
        """
        if self.param_groups:
            raise ConfigError("the engine's optimizer has one param group over its flat masters; a second one "
                              "(other parameters or other hyperparameters per parameter) is not supported: "
                              "set lr, weight_decay, momentum and betas on the engine, or change "
                              "engine.optimizer.param_groups[0][...] to change them for every parameter")
        super().add_param_group(param_group)

    def push_hyperparameters(self) -> None:
        """Copy what changed in ``param_groups[0]`` since the last push into every bucket's optimizer; a change that
        cannot be exact (``dampening`` other than 0, ``differentiable=True``) raises ConfigError."""
        changed = {k: v for k, v in self.param_groups[0].items()
                   if k != "params" and (k not in self._pushed or self._pushed[k] is not v)}
        if changed.get("dampening", 0) != 0:
            raise ConfigError(f"param_groups[0]['dampening'] = {changed['dampening']!r}: {_REFUSED['dampening']}")
        if changed.get("differentiable"):
            raise ConfigError(f"param_groups[0]['differentiable'] = True: {_REFUSED['differentiable']}")
        if changed:
            for o in self.optimizers:
                o.param_groups[0].update(changed)
            if self._multi is not None:
                self._multi.param_groups[0].update(changed)
            self._pushed.update(changed)

    def step_all(self, found_inf: torch.Tensor | None = None) -> None:
        """One multi-tensor step (:attr:`multi`) over every master with a ``.grad``, on its own optimizer's state.
        ``found_inf``: a bool 0-dim tensor on the masters' device, or None; fused takes it as torch's ``GradScaler``
        passes it, ``foreach`` masks as :meth:`step_bucket`.

        Raises:
            ConfigError: :attr:`multi` is None (the per-master path has no multi-tensor step).
        """
        if self.multi is None:
            raise ConfigError("GroupedOptimizer.step_all: no multi-tensor kind on this device (multi is None); "
                              "step the masters with step_bucket")
        if self._multi is None or self._multi.defaults.get(self.multi) is not True:
            first = self.optimizers[0]
            hyper = {k: v for k, v in first.param_groups[0].items()
                     if k not in ("params", "foreach", "fused", "capturable")}
            self._multi = type(first)([{**hyper, "params": list(self.masters)}], **{self.multi: True})
            for o, m in zip(self.optimizers, self.masters, strict=True):
                self._multi.state[m] = o.state[m]  # the same dict: state made by either is both's
        if found_inf is None:
            self._multi.step()
            return
        stepped = [(o, m) for o, m in zip(self.optimizers, self.masters, strict=True) if m.grad is not None]
        _masked_step(self._multi.step, found_inf, self._multi if self.multi == "fused" else None, stepped)

    def step_bucket(self, i: int, parts: list[tuple[int, int, int]] | None = None,
                    found_inf: torch.Tensor | None = None) -> None:
        """Update master ``i`` from its ``.grad``; with ``parts``, only those elements.

        On the CPU :data:`CPU_CHUNK` elements at a time (element-wise: the numbers of one step over the master).

        Args:
            parts: ``(start, end, steps)`` element ranges of master ``i``, each with the steps its parameter has taken
                (Adam's bias correction counts them per parameter); the other elements and their state are left as
                torch.optim leaves a parameter whose ``.grad`` is None. None: all of it.
            found_inf: bool 0-dim tensor on the master's device (as torch's ``GradScaler`` passes it), or None: the
                update is kept only where it is False, with nothing read on the host (an overflowed first step leaves
                the state torch would create: zero moments, step 0).
        """
        if found_inf is None:
            self._step_master(i, parts)
            return
        opt = self.optimizers[i]
        # Fused: skipped inside the kernel, as GradScaler has it (parts step another optimizer, masked).
        fused = opt if opt.defaults.get("fused") and parts is None else None
        _masked_step(lambda: self._step_master(i, parts), found_inf, fused, [(opt, self.masters[i])])

    def _step_master(self, i: int, parts: list[tuple[int, int, int]] | None) -> None:
        """:meth:`step_bucket` without an overflow flag."""
        opt, master = self.optimizers[i], self.masters[i]
        if parts is None and (master.device.type != "cpu" or master.numel() <= CPU_CHUNK):
            opt.step()
            return
        state = opt.state[master]
        if not state:
            state.update(_fresh_state(opt, master))
        if parts is None:  # a large master on the CPU: all of it, at its own step count
            parts = [(0, master.numel(), int(state.get("step", 0)))]
        if master.device.type == "cpu":
            parts = [(a, min(a + CPU_CHUNK, end), steps) for start, end, steps in parts
                     for a in range(start, end, CPU_CHUNK)]
        # The same torch optimizer over views of the master and its state, each range with its own step count.
        views = [nn.Parameter(master.detach()[a:b]) for a, b, _ in parts]  # sharing the master's storage
        partial = type(opt)([{**opt.param_groups[0], "params": views}])
        for view, (a, b, steps) in zip(views, parts, strict=True):
            view.grad = master.grad[a:b]
            partial.state[view] = {k: (v[a:b] if torch.is_tensor(v) and v.dim() > 0 else
                                       torch.tensor(float(steps), dtype=v.dtype, device=v.device)
                                       if torch.is_tensor(v) else v)
                                   for k, v in state.items()}
        partial.step()
        if "step" in state:
            state["step"] += 1

    # With this, torch.amp.GradScaler passes itself to step() (grad_scaler=) instead of unscaling: refused there.
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """Bound: the engine's step; unbound: update every master with a ``.grad``. ``closure`` is called first, with
        gradients enabled, as in torch.

        Returns:
            ``closure()``'s value, or None. Whether the engine stepped (False: an fp16 overflow) is :attr:`stepped`.

        Raises:
            ConfigError: the engine was closed or garbage collected; ``torch.amp.GradScaler`` stepping it
                (``grad_scaler``); or any error of ``engine.step()``.
        """
        if grad_scaler is not None:
            raise ConfigError(
                "torch.amp.GradScaler.step(engine.optimizer): the engine keeps its own dynamic loss scale, "
                'applied in its backward and undone in its step; build the engine with dtype="fp16" and call '
                "engine.backward(loss) and engine.step() without a GradScaler (bf16 needs no scale)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._engine is None:
            self.push_hyperparameters()
            for o in self.optimizers:
                o.step()
            return loss
        engine = self._engine()
        if engine is None:
            raise ConfigError("this optimizer's engine was garbage collected: nothing is left to step")
        self.stepped = engine._step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Bound to an engine: ``engine.zero_grad(set_to_none)``; else torch's on every master."""
        engine = self._engine() if self._engine is not None else None
        if engine is not None:
            engine.zero_grad(set_to_none=set_to_none)
            return
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """Bound: the whole state as one torch optimizer over ``model.parameters()`` holds it, loadable at any stage,
        world size or bucket size and into plain torch (a collective, call on every rank:
        :meth:`~zerolearn.engines.state.EngineStateMixin.full_optimizer_state_dict`). Else :meth:`shard_state_dict`."""
        engine = self._engine() if self._engine is not None else None
        if engine is None:
            return self.shard_state_dict()
        self.push_hyperparameters()
        return engine.full_optimizer_state_dict()

    def shard_state_dict(self) -> dict:
        """``{"state": {i: state of master i}, "param_groups": [{hyperparameters, "params": [0, ..., G-1]}],
        "shards_of_rank": rank}``: one torch optimizer over this rank's masters; ``rank`` (the engine's when bound,
        else None) is checked on load."""
        self.push_hyperparameters()
        parts = [o.state_dict() for o in self.optimizers]
        state = {i: part["state"][0] for i, part in enumerate(parts) if 0 in part["state"]}
        group = {**parts[0]["param_groups"][0], "params": list(range(len(parts)))}
        engine = self._engine() if self._engine is not None else None
        return {"state": state, "param_groups": [group], "shards_of_rank": engine.rank if engine is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s layout (a plain torch optimizer's too) or :meth:`shard_state_dict`'s (whose param
        groups may split the indices; ``param_groups[0]`` then shows master 0's hyperparameters).

        Raises:
            ConfigError: a shard state dict of another rank; any error of ``load_full_optimizer_state_dict``.
            ValueError: a shard state dict that does not name exactly the masters 0..G-1.
        """
        engine = self._engine() if self._engine is not None else None
        if "shards_of_rank" not in state_dict and engine is not None:
            engine.load_full_optimizer_state_dict(state_dict)
            return
        owner = state_dict.get("shards_of_rank")
        if engine is not None and owner is not None and owner != engine.rank:
            raise ConfigError(f"this optimizer state holds rank {owner}'s shards of the masters and this is rank "
                              f"{engine.rank}: load each rank's own (engine.optimizer.shard_state_dict()), or the "
                              "whole state, engine.optimizer.state_dict(), which every rank can load")
        groups = {i: g for g in state_dict["param_groups"] for i in g["params"]}
        if sorted(groups) != list(range(len(self.optimizers))):
            raise ValueError(f"optimizer state dict for params {sorted(groups)}: this engine has "
                             f"{len(self.optimizers)} flat masters (0..{len(self.optimizers) - 1})")
        for i, o in enumerate(self.optimizers):
            state = {0: state_dict["state"][i]} if i in state_dict["state"] else {}
            o.load_state_dict({"state": state, "param_groups": [{**groups[i], "params": [0]}]})
        hyper = {k: v for k, v in self.optimizers[0].param_groups[0].items() if k != "params"}
        self.param_groups[0].update(hyper)
        self._pushed = dict(hyper)
        self._multi = None  # its shared state dicts were replaced: built again at the next step_all


def _masked_step(step, found_inf: torch.Tensor, fused: torch.optim.Optimizer | None, stepped: list) -> None:
    """``step()``, its update kept only where ``found_inf`` (a bool 0-dim tensor) is False, with nothing read on the
    host. ``fused`` (the fused optimizer ``step()`` runs, or None) takes the flag as torch's ``GradScaler`` passes it
    and skips inside its kernel; else each ``(opt, master)`` of ``stepped`` has its master and per-element state put
    back (``torch.where``) and its step count taken back by the flag."""
    if fused is not None:
        fused.found_inf = found_inf.float()
        try:
            step()
        finally:
            del fused.found_inf
        return
    triples = [(opt, master, opt.state[master]) for opt, master in stepped]  # step_all's optimizer shares these
    for opt, master, state in triples:
        if not state:
            state.update(_fresh_state(opt, master))
    kept = [t for _, master, state in triples
            for t in [master.detach(), *state.values()] if torch.is_tensor(t) and t.dim() > 0]
    before = [t.clone() for t in kept]
    step()
    for t, old in zip(kept, before, strict=True):
        t.copy_(torch.where(found_inf, old, t))
    for _, _, state in triples:
        if torch.is_tensor(state.get("step")):
            state["step"].sub_(found_inf.to(state["step"].device, state["step"].dtype))


class Stepped:
    """Whether an engine's step updated the parameters, from ``found_inf`` (a bool 0-dim tensor, True: an overflow
    skipped it), read lazily: the step never waits for the device, ``bool()`` does. Compares, hashes, pickles as a bool.
    """

    __slots__ = ("_found_inf", "_value")

    def __init__(self, found_inf: torch.Tensor):
        self._found_inf, self._value = found_inf, None

    def __bool__(self) -> bool:
        if self._value is None:
            self._value = not bool(self._found_inf)
            self._found_inf = None
        return self._value

    def __eq__(self, other) -> bool:
        return bool(self) == other

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return repr(bool(self))

    def __reduce__(self):
        return bool, (bool(self),)


def _fresh_state(opt: torch.optim.Optimizer, master: torch.Tensor) -> dict:
    """The state torch's ``opt`` creates for ``master`` on its first step, before the update (SGD's zero momentum
    buffer: its first update, 0 * momentum + grad, equals torch's clone of the first gradient)."""
    if isinstance(opt, torch.optim.SGD):
        return {"momentum_buffer": torch.zeros_like(master)} if opt.param_groups[0]["momentum"] else {}
    on_device = opt.defaults.get("fused") or opt.defaults.get("capturable")  # torch keeps the count there
    step = torch.tensor(0.0, dtype=torch.float32 if on_device else torch.get_default_dtype(),
                        device=master.device if on_device else None)
    moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if opt.param_groups[0].get("amsgrad") else [])
    return {"step": step, **{k: torch.zeros_like(master) for k in moments}}


def make_grouped(name: str, masters: list[nn.Parameter], lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 options: dict | None = None) -> GroupedOptimizer:
    """:class:`GroupedOptimizer` of :func:`make_optimizer`'s ``name``, one per master (:func:`multi_tensor_kind`).

    Raises:
        ConfigError: ``name`` is not one of :data:`OPTIMIZERS`.
    """
    kind = multi_tensor_kind(masters[0].device) if masters else None
    return GroupedOptimizer([make_optimizer(name, [m], lr, weight_decay, momentum, betas, kind, options)
                             for m in masters], list(masters))


def optimizer_state(optimizer: torch.optim.Optimizer | GroupedOptimizer, master: torch.Tensor) -> list[torch.Tensor]:
    """The optimizer's per-element state tensors of ``master`` (Adam's moments, SGD's momentum; no scalars)."""
    return [v for v in optimizer.state.get(master, {}).values() if torch.is_tensor(v) and v.dim() > 0]


def model_device(model: nn.Module) -> torch.device:
    """The one device all of ``model``'s parameters and buffers are on.

    Raises:
        ConfigError: the model has no parameters, or they sit on several devices.
    """
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if not devices:
        raise ConfigError("the model has no parameters to train")
    if len(devices) > 1:
        raise ConfigError(f"model parameters sit on different devices {sorted(map(str, devices))}; "
                          "move the model to one device (model.to(device)) first")
    return devices.pop()


def parts_to_step(optimizer: GroupedOptimizer, i: int, b, used: list[bool]) -> list[tuple[int, int, int]] | None:
    """Which elements of bucket ``b``'s master (the ``i``-th) to update this step; counts in ``b.skipped`` a skipped
    step for each parameter not ``used`` (per parameter, by any rank). None (all of it) when every parameter in this
    rank's part was used and, for Adam, none ever sat out a step; else per used parameter ``(start, end, steps taken)``
    in master coordinates (:meth:`GroupedOptimizer.step_bucket`).
    """
    lo, hi = (0, b.layout.padded_numel) if b.master.numel() == b.layout.padded_numel else b.layout.shard_range
    mine = [j for j, (p, off) in enumerate(zip(b.params, b.layout.offsets, strict=True))
            if off < hi and off + p.numel() > lo]
    counts_steps = not isinstance(optimizer.optimizers[i], torch.optim.SGD)
    for j, flag in enumerate(used):
        b.skipped[j] += not flag
    if all(used[j] for j in mine) and not (counts_steps and any(b.skipped[j] for j in mine)):
        return None
    taken = int(optimizer.optimizers[i].state.get(b.master, {}).get("step", 0))  # steps the whole bucket has taken
    return [(max(off, lo) - lo, min(off + b.params[j].numel(), hi) - lo, taken - b.skipped[j])
            for j in mine for off in [b.layout.offsets[j]] if used[j]]


def replica_weights(buckets, nm: int) -> list[list[tuple[int, int, float]]]:
    """Per bucket, ``(start, end, weight)`` element ranges of the master (its shard range; the whole buffer at stage 0).

    For tensor parallelism over ``nm`` ranks (Nm): weight 1 for a parameter marked ``tensor_parallel = True`` (a slice
    that differs per rank), 1/Nm for a replica, so the sum of squares over the Nm ranks counts each element once.
    """
    out = []
    for b in buckets:
        lo, hi = b.layout.shard_range
        spans = [(p, max(off, lo), min(off + p.numel(), hi)) for p, off in zip(b.params, b.layout.offsets, strict=True)]
        out.append([(a - lo, e - lo, 1.0 if getattr(p, "tensor_parallel", False) else 1.0 / nm)
                    for p, a, e in spans if a < e])
    return out


def sum_of_squares(grads: list[torch.Tensor], weights: list[list[tuple[int, int, float]]] | None,
                   device: torch.device) -> torch.Tensor:
    """Sum of squares of this rank's gradient elements, an fp32 scalar on ``device``; ``weights``
    (:func:`replica_weights`) counts replicas 1/Nm, None every element once. The global norm is the square root of this
    summed over the ranks holding different parts (the formula of ``clip_grad_norm_``).
    """
    if weights is None:
        return torch.stack([gr.float().pow(2).sum() for gr in grads]).sum()
    return torch.stack([gr[a:b].float().pow(2).sum() * w for gr, ranges in zip(grads, weights, strict=True)
                        for a, b, w in ranges] or [torch.zeros((), device=device)]).sum()
