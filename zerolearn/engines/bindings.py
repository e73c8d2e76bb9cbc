"""The model's parameters stay the engine's: checked when it wraps them and before each step.

Each views a bucket's flat buffer (:meth:`zerolearn.flat.FlatLayout.bind`); what would leave
one outside it, to train wrongly without a word, raises a ConfigError with the fix instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from zerolearn.errors import ConfigError


def refuse_unsupported(model: nn.Module, trainable: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse, at wrap time, parameters a flat real buffer cannot hold.

    Raises:
        ConfigError: naming the parameter or module and the fix: a lazy module not yet
            initialised (``nn.LazyLinear``: no shape until a first forward); an embedding with
            ``max_norm`` (it renormalises looked-up rows in place, so ranks drift apart, which
            DDP and FSDP2 let pass); a complex parameter (keep its real view, shape ``(..., 2)``);
            an embedding with ``sparse=True`` (the engines reduce dense flat buckets).
    """
    lazy = [name or "<model>" for name, p in model.named_parameters()
            if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ConfigError(f"{', '.join(lazy[:4])}: an uninitialised lazy parameter (nn.LazyLinear, nn.LazyConv2d, "
                          "...) has no shape yet, so no bucket can hold it; run one forward on a batch (or "
                          "call the module's initialize_parameters) before wrapping the model")
    renormed = [name or "<model>" for name, m in model.named_modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None and m.weight.requires_grad]
    if renormed:
        raise ConfigError(
            f"{', '.join(renormed[:4])}: an embedding with max_norm= rescales the rows it looks up in place during "
            "forward, outside autograd and the optimizer, so ranks that see different tokens end the step with "
            "different weights (DDP and FSDP2 let them drift apart in silence); build it with max_norm=None")
    complex_ = [name for name, p in trainable if p.is_complex()]
    if complex_:
        raise ConfigError(
            f"complex parameters ({', '.join(complex_[:4])}{' and more' if len(complex_) > 4 else ''}): the "
            "engines keep parameters in flat real buffers. Store such a parameter as its real view, "
            "nn.Parameter(torch.view_as_real(w)) of shape (..., 2), and use torch.view_as_complex(self.w) in "
            "forward: the same numbers train exactly (torch's optimizers step a complex parameter as that view)")
    sparse = [name or "<model>" for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise ConfigError(
            f"{', '.join(sparse[:4])}: an embedding with sparse=True makes sparse gradients, and the engines "
            "reduce dense flat buckets; build it with sparse=False (the gradient is then dense, as DDP's "
            "buckets hold it too)")


# Every trainable parameter of a model an open engine wraps -> that engine (a weak reference).
_OWNED = WeakIdKeyDictionary()


def own(engine_ref, params) -> None:
    """Record ``params`` as the engine's (``engine_ref``, a weak reference) for :func:`_refuse_foreign_step`."""
    for p in params:
        _OWNED[p] = engine_ref


def disown(params) -> None:
    """The engine is closed: its parameters may be stepped by any optimizer again."""
    for p in params:
        _OWNED.pop(p, None)


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """torch's global optimizer step pre-hook: a ConfigError for another optimizer stepping a
    wrapped model's parameters (DDP's habit, ``SGD(model.parameters())``)."""
    if not _OWNED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _OWNED.get(p)
            engine = ref() if ref is not None else None
            if engine is not None and not engine._closed:
                names = {id(q): n for n, q in engine.model.named_parameters()}
                raise ConfigError(
                    f"{type(optimizer).__name__}.step() over the wrapped model's parameters ({names.get(id(p), '?')} "
                    "...): the engine keeps the reduced gradient in its buckets and steps its own fp32 masters, so "
                    "another optimizer would step what p.grad shows (a bucket view or nothing) and the masters "
                    "would overwrite it; use the engine's optimizer, engine.optimizer (engine.step()), with "
                    "make_engine(..., optimizer=, lr=, weight_decay=, momentum=, betas=, optimizer_kwargs=)")


register_optimizer_step_pre_hook(_refuse_foreign_step)


def refuse_sparse_grad(name: str) -> None:
    """Raise the ConfigError for a sparse gradient that reached parameter ``name``."""
    raise ConfigError(f"parameter {name} received a sparse gradient (F.embedding(..., sparse=True) or a "
                      "module built with sparse=True): the engines reduce dense flat buckets; use sparse=False")


class Bindings:
    """Where each trainable parameter must be: under which names in the model, viewing which buffer.

    Args:
        model: the wrapped model.
        buckets: the engine's buckets, their parameters already bound to (viewing) ``b.full``.
    """

    def __init__(self, model: nn.Module, buckets: list):
        self.model = model
        self.buckets = buckets
        where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        # By module (each looked up once): attribute, parameter, bucket, index, has an address (size > 0).
        by_path: dict[tuple[str, ...], list] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in where:
                *path, attr = name.split(".")
                by_path.setdefault(tuple(path), []).append((attr, p, *where[id(p)], p.numel() > 0))
        self.modules = list(by_path.items())
        # Frozen when the engine wrapped the model: a later requires_grad_(True) is named.
        self.frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]

    def check(self, when: str) -> None:
        """Raise if a parameter was replaced or its data moved out of its bucket; O(parameters).

        Args:
            when: what is about to happen, for the message ("forward", "step").

        Raises:
            ConfigError: naming the parameter, what happened and the fix; also for a parameter
                frozen when the engine was built whose ``requires_grad`` was set since.
        """
        for name, p in self.frozen:
            if p.requires_grad:
                raise ConfigError(
                    f"parameter {name} was frozen (requires_grad=False) when the engine was built and has "
                    f"requires_grad=True now, before the {when}: the engine trains the parameters that were "
                    "trainable when it wrapped the model, so it would never train. Set requires_grad on every "
                    "parameter before building the engine (unfreeze a layer by building a new engine, loading "
                    "the trained values with engine.load_state_dict or a checkpoint)")
        storages = {id(b): b.full.untyped_storage() for b in self.buckets}
        for path, entries in self.modules:
            module = self.model
            for part in path:  # None once a module on the path is gone
                module = None if module is None else module._modules.get(part)
            for attr, p, b, i, sized in entries:
                if module is None or module._parameters.get(attr) is not p:
                    self._replaced(".".join([*path, attr]), module, attr, when)
                storage = storages[id(b)]
                # One address says "this bucket's storage, at this parameter's offset" while
                # that storage holds memory; a freed one (ZeRO-3) is compared by identity.
                if p.dtype != b.full.dtype or (
                        p.data_ptr() != storage.data_ptr() + b.layout.offsets[i] * p.element_size()
                        if sized and storage.data_ptr()
                        else p.untyped_storage()._cdata != storage._cdata or p.storage_offset() != b.layout.offsets[i]):
                    self._moved(".".join([*path, attr]), p, when)

    @staticmethod
    def _replaced(name: str, module: nn.Module | None, attr: str, when: str) -> None:
        """Raise: parameter ``name`` is no longer the module's (ConfigError)."""
        now = None if module is None else module._parameters.get(attr)
        what = ("its module was replaced" if module is None else "it was removed" if now is None
                else "it was replaced by another parameter")
        raise ConfigError(
            f"parameter {name} is no longer the one the engine wrapped ({what} after the engine was "
            f"built), before the {when}: the engine trains the parameters it was given, so the new one "
            "would never train. Make every change to the model (a new head, a resized embedding, "
            "loaded weights by assignment) before building the engine, and load values with "
            "engine.load_state_dict or inside engine.summon_full_params()")

    @staticmethod
    def _moved(name: str, p: torch.Tensor, when: str) -> None:
        """Raise: parameter ``name``'s data left its bucket or changed dtype (ConfigError)."""
        raise ConfigError(
            f"parameter {name} no longer holds the engine's values (now {str(p.dtype).removeprefix('torch.')}"
            f", outside its bucket) before the {when}: its data was replaced after the engine was built, "
            "typically by a module that casts itself inside forward (self.classifier = "
            "self.classifier.to(torch.float32)) or by param.data = .... Its updates would be lost. Cast "
            "the input and output instead of the module (F.linear(x.float(), w.float())), train in that "
            "dtype, or change values in place inside engine.summon_full_params()")


class HeldGradient(torch.Tensor):
    """``p.grad`` between backward and step where no rank holds the whole reduced gradient of
    ``p`` (stages 1-3; fp16's scaled gradient; tensor parallelism): ``p``'s shape and dtype in
    zero bytes. Any torch op but reading shape, dtype or ``repr`` (``p.grad.data`` too) raises
    a ConfigError naming the engine's clipping, so ``clip_grad_norm_(model.parameters())``
    fails loudly instead of the 0.0 torch returns when every ``p.grad`` is None.

    Attributes:
        stage: the engine's stage (0-3), for the message; -1: a master's in ``engine.optimizer``.
    """

    stage: int

    @classmethod
    def make(cls, p: torch.Tensor, stage: int) -> HeldGradient:
        """The held gradient of parameter ``p``: zero bytes, expanded to ``p``'s shape."""
        with torch._C.DisableTorchFunctionSubclass():
            held = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(cls)
        held.stage = stage
        return held

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        # p.grad.data (a getter whose __self__ is named "data") would hand out the zeros underneath.
        if name in _READS_NOTHING and not (
                name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = "data" if name == "__get__" else name
        held = next((x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else (a,))
                     if isinstance(x, HeldGradient)), None)
        if name == "__repr__" and held is not None:
            return (f"HeldGradient(shape={tuple(held.shape)}): the engine (stage {held.stage}) holds this "
                    "parameter's reduced gradient in its buckets, not here")
        if held is not None and held.stage < 0:  # a master of engine.optimizer.param_groups
            why = "the optimizer's fp32 masters get their gradient only inside engine.step()"
        elif held is None or held.stage > 0:
            why = "each rank holds only its 1/Nd shard of the reduced gradient"
        else:
            why = "this gradient is still multiplied by fp16's loss scale, or is one tensor-parallel slice"
        if name and name.endswith("_") and not name.startswith("__"):  # clamp_: clip_grad_value_; mul_, ...
            raise ConfigError(
                f"p.grad was written in place ({name}) between backward and step, where {why}: the write would "
                "reach no gradient the step uses. torch.nn.utils.clip_grad_value_ writes so; the engine clips by "
                "norm only (max_grad_norm= or engine.clip_grad_norm_(max_norm)); at stage 0 in fp32 or bf16, "
                "p.grad is the reduced gradient itself and clip_grad_value_ works there as in DDP")
        raise ConfigError(
            f"p.grad was read ({name}) between backward and step, where {why}: "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) or a norm of p.grad would see no true "
            "gradient. Clip with the engine's max_grad_norm= option or engine.clip_grad_norm_(max_norm) "
            "(the global norm, exactly, returned as torch's is); stage 0 in fp32 or bf16 gives p.grad as "
            "the reduced gradient itself")


# Tensor methods and attributes that read no element: allowed on a HeldGradient.
_READS_NOTHING = frozenset({"__get__", "__set__", "size", "dim", "ndimension", "numel", "nelement", "__len__",
                            "stride", "storage_offset", "element_size", "is_floating_point", "is_complex",
                            "is_contiguous", "get_device", "data_ptr", "untyped_storage", "__hash__"})
