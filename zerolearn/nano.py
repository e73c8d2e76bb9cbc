"""nano-ZeRO: ZeRO-DP's four stages in one file, assembled from the book's exercises
(paper Sec 5.1-5.3 for the stages, Sec 7 for what they move, Fig 1 for what they keep).

Usage, on every rank of a process group (``zerolearn.dist.launch`` or ``zerolearn.live``)::

    engine = NanoZero(model, stage=2, lr=1e-3)                        # the book's solutions
    engine = NanoZero(model, stage=2, lr=1e-3, parts={"zero1_step": zero1_step})   # yours
    loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
    engine.backward(loss)
    engine.step()
    engine.zero_grad()

Each stage is a few lines here; what it does is the exercises' functions (:data:`PARTS`),
by default the reference solutions in ``zerolearn/chapters/chNN/<name>.py``, any of them
replaced by the reader's through ``parts``:

* stage 0, DP (chapter 1): ``bucket_hook`` all-reduces the gradient from autograd hooks
  while backward runs (or ``average_gradients`` after it, if given instead); the step is
  ``zero1_step`` with one shard, the whole buffer, already reduced;
* stage 1, P_os (chapter 2): ``shard_range`` lays out the flat buffer, ``zero1_step``
  reduce-scatters the gradient, steps this rank's fp32 master shard, all-gathers;
* stage 2, P_os+g (chapter 3): ``reduce_scatter_hook`` reduces the gradient into this
  rank's shard during backward and frees the full one; ``zero1_step`` steps and gathers;
* stage 3, P_os+g+p (chapter 4): one flat buffer per unit (``model.units()``, else the
  model's children), freed between uses; ``gather_hooks`` (or ``prefetch``) gathers it
  around each unit's forward and backward, ``reduce_scatter_hook`` reduces its gradient,
  ``zero1_step`` steps the shard in place, with nothing to gather.

What the package's engines add (:mod:`zerolearn.engines`: buckets of a fixed size, fp16
with a loss scale, gradient accumulation, clipping, fused prefetch windows, offload,
ZeRO++, the guards that keep ranks in step) is left out, so that a stage reads in one
sitting. The collectives go through :mod:`zerolearn.comm` (its ledger counts them) and
the model states are tagged for :mod:`zerolearn.memory.ledger`, so the book's memory and
Psi tables come out of this engine as out of the package's. Every stage equals training
in one process on the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.errors import ConfigError
from zerolearn.memory.ledger import category, retag, storage_bytes

PARTS = ("average_gradients", "bucket_hook", "shard_range", "zero1_step", "reduce_scatter_hook", "gather_hooks",
         "prefetch")
"""The exercises a NanoZero is made of (chapters 1-4), by the name of the reader's function."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def reference_parts() -> dict[str, Callable]:
    """The book's reference solutions of :data:`PARTS`, by name (from ``zerolearn/chapters``)."""
    from zerolearn.chapters.ch01.average_gradients import average_gradients
    from zerolearn.chapters.ch01.bucket_hook import bucket_hook
    from zerolearn.chapters.ch02.shard_range import shard_range
    from zerolearn.chapters.ch02.zero1_step import zero1_step
    from zerolearn.chapters.ch03.reduce_scatter_hook import reduce_scatter_hook
    from zerolearn.chapters.ch04.gather_hooks import gather_hooks
    from zerolearn.chapters.ch04.prefetch import prefetch

    return {"average_gradients": average_gradients, "bucket_hook": bucket_hook, "shard_range": shard_range,
            "zero1_step": zero1_step, "reduce_scatter_hook": reduce_scatter_hook, "gather_hooks": gather_hooks,
            "prefetch": prefetch}


class Flat:
    """Parameters laid end to end in one buffer padded to ``nd`` equal shards (Sec 5): the
    buffer ``full`` (the parameters become views of it), this rank's ``[start, end)``."""

    def __init__(self, params: list[nn.Parameter], nd: int, rank: int, dtype: torch.dtype, shard_range: Callable):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.start, self.end, self.padding = shard_range(self.numel, nd, rank)
        with category("params"):
            self.full = torch.zeros(self.numel + self.padding, dtype=dtype)
        offset = 0
        for p in params:  # copy in, then point the parameter at its view: one storage for the model
            view = self.full[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            offset += p.numel()


class NanoZero:
    """ZeRO-DP at ``stage`` 0-3 over the default process group, built from the exercises.

    Args:
        model: an ``nn.Module``, the same on every rank (same seed); its trainable
            parameters become views of flat buffers of ``dtype``. At stage 3 its
            ``units()`` (or its children with parameters, a ModuleList's items in its
            place) are the units gathered whole.
        stage: 0 (DP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p), Sec 5.1-5.3.
        lr: Adam's learning rate (torch.optim.Adam on fp32 masters, Sec 3.1: K = 12).
        dtype: ``"fp32"``, or ``"bf16"`` at stages 0 and 1 (``zero1_step`` keeps the fp32
            master; ``reduce_scatter_hook`` and the trials of chapters 3-4 are fp32).
        parts: the reader's functions by name (:data:`PARTS`), replacing the references.
        prefetch: stage 3 gathers with ``prefetch`` (the next unit in flight) instead
            of ``gather_hooks``.

    Raises:
        ConfigError: a stage outside 0-3, an unknown dtype or part, bf16 at stage 2 or 3, a
            stage-3 model whose units leave a parameter out or share one.
    """

    def __init__(self, model: nn.Module, stage: int, lr: float, *, dtype: str = "fp32",
                 parts: dict[str, Callable] | None = None, prefetch: bool = False):
        self.check_options(stage, dtype, parts)
        self.fn = {**reference_parts(), **(parts or {})}
        # Stage 0 averages after backward (chapter 1's naive DP) when that is the part given.
        self.naive = "average_gradients" in (parts or {}) and "bucket_hook" not in (parts or {})
        ctx = zdist.context()
        self.model, self.stage, self.lr, self.dtype, self.prefetch = model, stage, lr, DTYPES[dtype], prefetch
        self.nd, self.rank = ctx.world_size, ctx.rank
        model.to(self.dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        self.psi = sum(p.numel() for p in params)
        shard_range = self.fn["shard_range"]
        self.flats, self.states, self.grad_shards, self.shards = [], [], [], []
        if stage < 3:
            # DP shards nothing: one "shard", the whole buffer, with no padding.
            nd, rank = (self.nd, self.rank) if stage else (1, 0)
            self.flats = [Flat(params, nd, rank, self.dtype, shard_range)]
            self.states = [{}]
        if stage == 0:
            # Gradients are views of one flat buffer that autograd accumulates into.
            self.finish = (lambda: self.fn["average_gradients"](model, self.nd)) if self.naive else \
                self.fn["bucket_hook"]([params], self.nd)
        if stage == 2:
            flat = self.flats[0]
            with category("grads"):
                self.grad_shards = [torch.zeros(flat.end - flat.start, dtype=self.dtype)]
            # Backward reduces into this rank's shard and frees the full gradient (Sec 5.2).
            self.fn["reduce_scatter_hook"](params, self.grad_shards[0], self.nd)
        if stage == 3:
            self._build_units(model, params)
        self.padding = sum(f.padding for f in self.flats)
        self.zero_grad()

    @staticmethod
    def check_options(stage: int, dtype: str, parts: dict[str, Callable] | None) -> None:
        """Raise the ConfigError of :class:`NanoZero` for these options, before any work."""
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"stage={stage!r}: allowed are 0, 1, 2 and 3")
        if dtype not in DTYPES or (dtype != "fp32" and stage >= 2):
            raise ConfigError(f"dtype={dtype!r} at stage {stage}: allowed are 'fp32', and 'bf16' at stages 0-1")
        unknown = sorted(set(parts or {}) - set(PARTS))
        if unknown:
            raise ConfigError(f"parts: {', '.join(map(repr, unknown))} unknown; allowed are {', '.join(PARTS)}")

    def _build_units(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        """Stage 3: a flat buffer, a shard and a gradient shard per unit, and their hooks (Sec 5.3)."""
        units = list(model.units()) if hasattr(model, "units") else []
        for child in [] if units else model.children():  # a ModuleList has no forward: its items are units
            units += list(child.values()) if isinstance(child, nn.ModuleDict) else \
                list(child) if isinstance(child, nn.ModuleList) else [child]
        units = [m for m in units if any(p.requires_grad for p in m.parameters())]
        owner: dict[int, int] = {}
        for u, unit in enumerate(units):
            for p in unit.parameters():
                if p.requires_grad and owner.setdefault(id(p), u) != u:
                    raise ConfigError(f"stage 3: a parameter {tuple(p.shape)} is in units {owner[id(p)]} and {u}; "
                                      "each parameter must be gathered with one unit")
        if len(owner) != len(params):
            raise ConfigError(f"stage 3: {len(params) - len(owner)} parameters are in no unit of "
                              f"{type(model).__name__}.units(); every parameter must be in one")
        for unit in units:
            mine = [p for p in unit.parameters() if p.requires_grad]
            flat = Flat(mine, self.nd, self.rank, self.dtype, self.fn["shard_range"])
            with category("params"):
                self.shards.append(flat.full[flat.start:flat.end].clone())  # the only copy a rank keeps
            with category("grads"):
                self.grad_shards.append(torch.zeros(flat.end - flat.start, dtype=self.dtype))
            # Freed until a hook gathers it: the storage keeps its place, 0 bytes (Sec 5.3).
            flat.full.untyped_storage().resize_(0)
            self.flats.append(flat)
            self.states.append({})
            self.fn["reduce_scatter_hook"](mine, self.grad_shards[-1], self.nd)
        fulls = [f.full for f in self.flats]
        if self.prefetch:
            self.fn["prefetch"](units, fulls, self.shards, self.nd)
        else:
            for unit, full, shard in zip(units, fulls, self.shards, strict=True):
                self.fn["gather_hooks"](unit, full, shard, self.nd)

    def __call__(self, *args, **kwargs):
        """The model's forward (at stage 3 each unit is gathered by its hooks, freed after)."""
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (this rank's mean loss on its slice of the batch). Stage 0
        leaves the mean over ranks in every ``p.grad``; stages 2-3 leave this rank's averaged
        gradient shards, the hooks having freed the full gradients; stage 1 leaves this
        rank's own gradient, reduced by the step."""
        loss.backward()
        if self.stage == 0:
            self.finish()

    def step(self) -> None:
        """Adam on each fp32 master shard (``zero1_step``; Sec 5.1), then the working parameters:
        all-gathered at stages 1-2 (Psi elements), the whole buffer at stage 0, the shard at 3."""
        for i, flat in enumerate(self.flats):
            if self.stage == 0:  # DP: one shard, the whole buffer, already averaged
                args = (flat.full, self.flat_grad, self.states[i], 1, 0)
                kwargs = dict(reduced=True, gather=False)
            elif self.stage == 1:
                args, kwargs = (flat.full, self.flat_grad, self.states[i], self.nd, self.rank), {}
            elif self.stage == 2:
                args, kwargs = (flat.full, self.grad_shards[i], self.states[i], self.nd, self.rank), dict(reduced=True)
            else:
                args = (self.shards[i], self.grad_shards[i], self.states[i], self.nd, self.rank)
                kwargs = dict(reduced=True, gather=False)
            self.fn["zero1_step"](*args, self.lr, **kwargs)
        # The master and Adam's moments appear inside the first step, among its temporaries.
        retag(self.state_tensors()["optimizer_states"], "optimizer_states")

    def zero_grad(self) -> None:
        """Stages 0-1: the parameters' gradients become zeroed views of one flat buffer (padded
        like the parameters), which backward accumulates into; stages 2-3: nothing (the
        hooks overwrite each gradient shard, and leave no full gradient)."""
        if self.stage >= 2:
            return
        flat = self.flats[0]
        if getattr(self, "flat_grad", None) is None:
            with category("grads"):
                self.flat_grad = torch.zeros_like(flat.full)
        self.flat_grad.zero_()
        offset = 0
        for p in flat.params:
            p.grad = self.flat_grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds as model states, by category of Fig 1: ``params`` (the full
        buffers at stages 0-2, the shards at 3; a unit gathered now counts too), ``grads`` (the
        flat gradient at 0-1, the shards at 2-3), ``optimizer_states`` (the fp32 masters and
        Adam's moments, K = 12 bytes per element of a shard)."""
        states = []
        for state in self.states:
            for opt in (v for v in state.values() if isinstance(v, torch.optim.Optimizer)):
                states += [t for g in opt.param_groups for t in g["params"]]
                states += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
            states += [v for v in state.values() if torch.is_tensor(v)]
        grads = self.grad_shards if self.stage >= 2 else [self.flat_grad]
        return {"params": [f.full for f in self.flats] + self.shards, "grads": grads, "optimizer_states": states}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes held now per category of :meth:`state_tensors`, measured from the tensors (each
        storage once): Fig 1's (2 + 2 + K) Psi with the stage's divisions by Nd, for the
        padded Psi (``psi + padding``) and the dtype's 2 or 4 bytes."""
        seen: set[int] = set()
        return {name: storage_bytes(tensors, seen) for name, tensors in self.state_tensors().items()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter by name, fp32, whole. At stage 3 each unit is all-gathered
        into a copy (a collective every rank must call; the comm ledger counts it)."""
        if self.stage == 3:
            gathered = {}
            for flat, shard in zip(self.flats, self.shards, strict=True):
                full = torch.empty(flat.numel + flat.padding, dtype=self.dtype)
                comm.all_gather(full, shard)
                offset = 0
                for p in flat.params:
                    gathered[id(p)] = full[offset:offset + p.numel()].view(p.shape).float()
                    offset += p.numel()
            return {n: gathered[id(p)] for n, p in self.model.named_parameters() if p.requires_grad}
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters() if p.requires_grad}
