"""What every stage shares: flat groups, gradient buckets from autograd hooks, the step.

An engine wraps a model and owns its training state. Stages differ only in what a
rank keeps of each flat group (Sec 5): the working parameters (full or a shard),
the gradients (full or a shard) and the optimizer's fp32 master and moments (full or
a shard). The stage files fill in four methods:

    _init_group(g, master32)   lay out g's working params, master and views
    _reduce(g) -> Handle       launch g's gradient reduction (a sum, async)
    _after_reduce(g)           finish it: keep what this rank needs
    _grad_for_step(g)          the gradient the optimizer steps g's master with
    _publish(g)                after the update, make new params visible

Gradient buckets (Sec 5.2). Each group is a bucket of at most ``bucket_mb``. A
``post_accumulate_grad`` hook on every parameter copies its gradient into the
group's flat gradient buffer and drops autograd's copy; when a group has all its
gradients, its reduction is launched asynchronously while backward goes on with
earlier layers. Groups launch in one fixed order on every rank (a group waits for
the ones before it), because collectives must be issued in the same order on all
ranks or they pair up wrongly; groups whose parameters got no gradient are launched
at the end of backward with zeros. So a parameter that no rank used in a step gets
a zero gradient (as in DeepSpeed), not torch.optim's "no gradient, no update":
plain SGD leaves it alone, but momentum, Adam's moments and weight decay still move
it. Frozen parameters (``requires_grad=False``) are not flattened or sharded at all.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import nn

from zerolearn import comm
from zerolearn.dist import ConfigError
from zerolearn.flat import FlatGroup, make_groups
from zerolearn.memory.ledger import category, retag
from zerolearn.precision import LossScaler, needs_master, parse_dtype

OPTIMIZERS = ("adam", "adamw", "sgd")
MAX_IN_FLIGHT = 2  # reductions launched but not finished; bounds live gradient buckets


def make_optimizer(name: str, params: list[nn.Parameter], lr: float, weight_decay: float = 0.0,
                   momentum: float = 0.0, betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """torch's own Adam / AdamW / SGD over the flat master tensors.

    Adam and SGD are element-wise, so stepping flat shards gives the same numbers as
    stepping the original tensors; that is what lets ZeRO shard them freely.
    """
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ConfigError(f"--optimizer {name!r}: allowed are {', '.join(OPTIMIZERS)}")


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


def _unique_storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once across calls."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class Engine:
    """Shared interface of the four stages: forward, backward, step, zero_grad, ledgers.

    Args:
        model: an ``nn.Module`` on one device, in fp32 (it is cast to ``dtype``).
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``; ``lr``, ``weight_decay``,
            ``momentum`` (SGD) and ``betas`` (Adam) as in torch.optim.
        dtype: working precision ``"fp32" | "bf16" | "fp16"`` (fp32 master for the
            2-byte ones, dynamic loss scale for fp16).
        bucket_mb: largest gradient bucket / flat group, MiB of working dtype.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        group: process group over the Nd data-parallel ranks (default: all ranks).
        units: ZeRO-3's gather/free units in forward order (default ``model.units()``
            if it exists, else the model's direct children; parameters shared by two
            units, such as tied embeddings, go to the root unit). A unit's parameters
            may be read only inside its own forward: the next unit in the list is
            prefetched while the current one runs, and a unit is freed when its
            forward returns.
        model_parallel_group: the tensor-parallel group of this rank (Nm > 1), so that
            clipping and the fp16 overflow check see the whole gradient: parameters
            marked ``tensor_parallel = True`` are slices that differ per rank, the
            others are replicas counted once.
        broadcast_buffers: copy every buffer (BatchNorm's running statistics) from
            data-parallel rank 0 at the start of each forward, as torch DDP does, so
            ranks never drift apart; False leaves them per rank (SyncBatchNorm is
            the way to make the statistics themselves global).

    Parameters no rank used in a step get a zero gradient, not "no gradient": plain
    SGD leaves them alone, but Adam's moments and weight decay still move them, where
    torch.optim skips a parameter whose ``.grad`` is None. A flat shard cannot tell
    "unused" from "zero" without a collective per step; DeepSpeed behaves the same.

    Raises:
        ConfigError: bad optimizer, dtype, lr or bucket size; parameters on several
            devices. All raised before anything is allocated or communicated.
    """

    stage: int = -1
    shards_grads_for_norm = True  # each rank holds a different part of the gradient

    def __init__(self, model: nn.Module, *, optimizer: str = "adam", lr: float = 1e-3,
                 weight_decay: float = 0.0, momentum: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), dtype: str = "fp32",
                 bucket_mb: float = 4.0, max_grad_norm: float | None = None,
                 group=None, units: list[nn.Module] | None = None, model_parallel_group=None,
                 broadcast_buffers: bool = True):
        self.dtype = parse_dtype(dtype)
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {optimizer!r}: allowed are {', '.join(OPTIMIZERS)}")
        if not (lr > 0 and math.isfinite(lr)):
            raise ConfigError(f"--lr {lr}: must be > 0 and finite")
        if not bucket_mb > 0:
            raise ConfigError(f"--bucket-mb {bucket_mb}: must be > 0")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"--max-grad-norm {max_grad_norm}: must be > 0")
        self.device = model_device(model)
        self.model, self.pg, self.mp_group = model, group, model_parallel_group
        self.rank = torch.distributed.get_rank(group)
        self.world_size = torch.distributed.get_world_size(group)
        self.buffer_src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        self.broadcast_buffers = broadcast_buffers and self.world_size > 1
        self.optimizer_name, self.max_grad_norm = optimizer, max_grad_norm
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16)
        self.mixed = needs_master(self.dtype)

        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("the model has no trainable parameters (all requires_grad=False)")
        self.psi = sum(p.numel() for _, p in trainable)
        self.groups = self._build_groups(trainable, units)
        self._norm_weights = self._replica_weights() if model_parallel_group is not None else None
        self._publishing: list[comm.Handle] = []  # all_gathers of updated shards in flight
        masters32 = [g.flatten(torch.float32, self.device) for g in self.groups]
        model.to(self.dtype)  # working precision for everything, frozen params included
        for g, m in zip(self.groups, masters32):
            self._init_group(g, m)
        del masters32
        self.optimizer = make_optimizer(optimizer, [g.master for g in self.groups], lr,
                                        weight_decay, momentum, betas)
        for g in self.groups:
            for i, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, g, i))
        self._next, self._pending, self._sync = 0, [], True
        self._no_sync_depth = 0  # > 0 inside no_sync()
        self.holds_reduced = False  # a sync backward ran since the last zero_grad()
        self.peak_grad_bytes = 0  # most gradient bytes held at once, measured
        self.temp_buffer_peak_bytes = 0  # largest fused communication buffer, bytes (Sec 6.2)
        self.in_backward = False

    # ----- layout ---------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.world_size

    def _build_groups(self, trainable, units) -> list[FlatGroup]:
        # Reverse registration order approximates the order gradients arrive in.
        return make_groups(trainable[::-1], self.bucket_bytes, self.dtype.itemsize,
                           self.num_shards, self.rank % self.num_shards)

    @property
    def padding(self) -> int:
        """Zero elements added to make groups divide into Nd equal shards."""
        return sum(g.padding for g in self.groups)

    def _replica_weights(self) -> list[list[tuple[int, int, float]]]:
        """Per group, ``(start, end, weight)`` element ranges of the gradient this rank
        steps with (:meth:`_grad_for_step`): weight 1 for a tensor-parallel slice,
        1/Nm for a replica, so the sum over the Nm ranks counts each element once."""
        nm = torch.distributed.get_world_size(self.mp_group)
        out = []
        for g in self.groups:
            lo, hi = g.shard_range  # the whole buffer at stage 0 (one shard)
            ranges = []
            for p, off in zip(g.params, g.offsets):
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a < b:
                    ranges.append((a - lo, b - lo, 1.0 if getattr(p, "tensor_parallel", False) else 1.0 / nm))
            out.append(ranges)
        return out

    # ----- forward / backward ------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model on this rank's slice of the batch.

        Floating-point tensor arguments are cast to the working dtype (the model runs
        in it); integer ones (token ids) pass unchanged. Buffers are first broadcast
        from data-parallel rank 0 (``broadcast_buffers``), except in forwards run
        inside backward (activation-checkpoint recomputation).
        """
        if self.broadcast_buffers and not self.in_backward:
            for buf in self.model.buffers():
                comm.broadcast(buf, src=self.buffer_src, group=self.pg, tag="buffers")
        cast = [a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return self.model(*cast, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Backpropagate ``loss`` (a scalar, this rank's mean) into the flat gradients.

        Gradient accumulation works however it is written; scale each micro-batch's
        loss by 1 / micro-batches yourself (the fp16 loss scale is applied here):

        * ``backward`` several times before ``step`` (as with plain PyTorch): every
          backward reduces its micro-batch at once and adds the result to the
          reduced gradient of the earlier ones. Stages 2 and 3 keep their saving
          (only the 1/Nd shard is held between micro-batches), at the price of one
          reduction per micro-batch (DeepSpeed does the same).
        * ``sync=False`` (or inside :meth:`no_sync`) for all but the last micro-batch:
          gradients add up locally and the last backward reduces the sum once, like
          DDP's ``no_sync``. One reduction per step, but every stage holds the full
          gradient (2 Psi bytes) until then, so stages 2 and 3 lose their gradient
          saving while accumulating.
        """
        sync = sync and self._no_sync_depth == 0
        if self.holds_reduced:
            for g in self.groups:
                self._keep_reduced(g)
        for g in self.groups:
            g.ready = 0
        self._next, self._sync = 0, sync
        self.in_backward = True  # forwards run now are recomputations (activation checkpointing)
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        finally:
            self.in_backward = False
        if sync:
            for g in self.groups[self._next:]:  # groups some parameter of which got no grad
                self._ensure_grad_buffer(g)
                self._launch(g)
            self._next = len(self.groups)
            while self._pending:
                self._finish_oldest()
            self.holds_reduced = True
        self._after_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally, unreduced;
        the first backward after it reduces the sum (as ``DistributedDataParallel.no_sync``).
        Saves communication, costs memory at stages 2 and 3 (see :meth:`backward`)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def _keep_reduced(self, g: FlatGroup) -> None:
        """Hook: a backward starts while ``g`` holds an earlier backward's reduced
        gradient; set it aside so this backward's reduction adds to it (stage 1)."""

    def _ensure_grad_buffer(self, g: FlatGroup) -> None:
        if g.grad_full is None:
            with category("grads"):
                g.grad_full = torch.zeros(g.padded_numel, dtype=self.dtype, device=self.device)
            self._track_grad_bytes()
            self._track_buffer(g.grad_full)

    def _track_buffer(self, t: torch.Tensor) -> None:
        # Every fused buffer a collective reads or writes is one group: at most bucket_mb
        # (CB, Sec 6.2), unless a single parameter is larger.
        self.temp_buffer_peak_bytes = max(self.temp_buffer_peak_bytes, t.numel() * t.element_size())

    def _track_grad_bytes(self) -> None:
        held = _unique_storage_bytes([t for g in self.groups for t in (g.grad_full, g.grad_shard)], set())
        self.peak_grad_bytes = max(self.peak_grad_bytes, held)

    def _on_grad(self, g: FlatGroup, i: int, p: nn.Parameter) -> None:
        # Called by autograd once p.grad holds this backward's full gradient of p.
        # (The hook receives the parameter, not the gradient.)
        self._ensure_grad_buffer(g)
        g.view_of(g.grad_full, i).add_(p.grad)
        p.grad = None  # autograd's copy is in the bucket now; free it
        g.ready += 1
        if g.ready == len(g.params):
            self._on_group_ready(g)

    def _on_group_ready(self, g: FlatGroup) -> None:
        if not self._sync:
            return
        while self._next < len(self.groups) and self.groups[self._next].ready == len(self.groups[self._next].params):
            self._launch(self.groups[self._next])
            self._next += 1

    def _launch(self, g: FlatGroup) -> None:
        # Average before summing, not after: a sum of Nd loss-scaled fp16 gradients can
        # overflow where each one does not.
        if self.world_size > 1:
            g.grad_full.div_(self.world_size)
        self._pending.append((g, self._reduce(g)))
        while len(self._pending) > MAX_IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        g, handle = self._pending.pop(0)
        handle.wait()
        self._after_reduce(g)

    def _after_backward(self) -> None:
        """Hook for ZeRO-3 (free what backward left gathered)."""

    # ----- step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Update parameters from the reduced gradients; False if fp16 overflow skipped it.

        Global-norm clipping and the overflow check share one number: the sum of
        squares of this rank's gradient elements, all-reduced over ranks when ranks
        hold different parts (stages 1-3, and the tensor-parallel group), the same
        formula as ``torch.nn.utils.clip_grad_norm_``.
        """
        grads = [self._grad_for_step(g) for g in self.groups]
        coef, found_inf = 1.0 / self.scaler.scale, False
        if self.max_grad_norm is not None or self.scaler.enabled:
            sq = self._sum_of_squares(grads)
            if self.shards_grads_for_norm and self.world_size > 1:
                comm.all_reduce(sq, group=self.pg)
            if self.mp_group is not None:  # tensor-parallel ranks hold other slices
                comm.all_reduce(sq, group=self.mp_group, tag="tp")
            norm = sq.sqrt().item() / self.scaler.scale
            found_inf = not torch.isfinite(torch.tensor(norm)).item()
            if self.max_grad_norm is not None and not found_inf:
                coef *= min(1.0, self.max_grad_norm / (norm + 1e-6))
            self.last_grad_norm = norm
        self.scaler.update(found_inf)
        if found_inf:
            return False
        for g, gr in zip(self.groups, grads):
            # One group at a time, so at most one group's fp32 gradient exists at once;
            # tensors whose .grad is None are skipped by torch.optim.
            g.master.grad = gr.float() if gr.dtype != torch.float32 else gr
            if coef != 1.0:
                g.master.grad.mul_(coef)
            self.optimizer.step()
            retag(self._optimizer_state(g.master), "optimizer_states")
            g.master.grad = None
            self._publish(g)
        self._finish_publish()
        return True

    def _sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of this rank's gradient elements (fp32 scalar); replicas of
        tensor parallelism weighted 1/Nm (:meth:`_replica_weights`)."""
        if self._norm_weights is None:
            return torch.stack([gr.float().pow(2).sum() for gr in grads]).sum()
        return torch.stack([gr[a:b].float().pow(2).sum() * w for gr, ranges in zip(grads, self._norm_weights)
                            for a, b, w in ranges] or [torch.zeros((), device=self.device)]).sum()

    def _finish_publish(self) -> None:
        """Wait for the parameter all_gathers that :meth:`_publish` launched."""
        for handle in self._publishing:
            handle.wait()
        self._publishing.clear()

    def zero_grad(self) -> None:
        """Drop all gradients (buffers are allocated again in the next backward)."""
        for g in self.groups:
            g.grad_full = g.grad_shard = None
        self.holds_reduced = False

    # ----- ledgers ------------------------------------------------------------------
    def _optimizer_state(self, master: torch.Tensor) -> list[torch.Tensor]:
        # Per-element state only; Adam's scalar step counters are bookkeeping.
        return [v for v in self.optimizer.state.get(master, {}).values() if torch.is_tensor(v) and v.dim() > 0]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds as model states, by category (None: not held).

        ``params``: working parameters (full buffers, or shards under ZeRO-3);
        ``grads``: flat gradient buffers and shards; ``optimizer_states``: the fp32
        master (a storage of its own only in mixed precision) and the optimizer's
        per-element state (Adam's moments, SGD's momentum). Frozen parameters are not
        model states (Psi counts trainable ones).
        """
        return {"params": [t for g in self.groups for t in (g.full, g.shard)],
                "grads": [t for g in self.groups for t in (g.grad_full, g.grad_shard)],
                "optimizer_states": [t for g in self.groups for t in [g.master, *self._optimizer_state(g.master)]]}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now per category of :meth:`state_tensors`, measured
        from the tensors (each storage counted once, in the first category holding it)."""
        seen: set[int] = set()
        return {name: _unique_storage_bytes(tensors, seen) for name, tensors in self.state_tensors().items()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full and fp32, from the masters (a collective).

        Shapes as in the model; gathered with one all_gather per group when the master
        is sharded. Call on every rank.
        """
        out = {}
        for g in self.groups:
            master = g.master.detach().float()
            if g.master.numel() != g.padded_numel:
                full = torch.empty(g.padded_numel, device=self.device)
                comm.all_gather(full, master.contiguous(), group=self.pg)
                master = full
            for name, view in zip(g.names, g.views(master)):
                out[name] = view.clone()
        return out

    def state_dict(self) -> dict:
        """This rank's training state (shards), to resume at the same stage and Nd."""
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "masters": [g.master.detach().clone() for g in self.groups],
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of the same stage, Nd and rank.

        Raises:
            ValueError: stage, world size, rank or shard sizes differ.
        """
        mine = (self.stage, self.world_size, self.rank)
        theirs = (state["stage"], state["world_size"], state["rank"])
        if mine != theirs:
            raise ValueError(f"state of (stage, world_size, rank)={theirs} cannot load into {mine}")
        for g, m in zip(self.groups, state["masters"], strict=True):
            if m.shape != g.master.shape:
                raise ValueError(f"master shard shape {tuple(m.shape)} != {tuple(g.master.shape)}")
        self.load_shards(state["masters"], state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])

    @torch.no_grad()
    def load_shards(self, masters: list[torch.Tensor], optimizer_state: dict) -> None:
        """Set every group's fp32 master and the optimizer's state, then republish.

        Args:
            masters: one tensor per group, shaped as ``g.master`` (this rank's shard,
                ``g.shard_range`` of the group's flat buffer; the whole buffer at stage 0).
            optimizer_state: a ``torch.optim`` state dict for ``self.optimizer``.

        Republishing rebuilds the working parameters from the new masters (an
        all_gather per group at stages 1-2): a collective, call on every rank.
        """
        for g, m in zip(self.groups, masters, strict=True):
            g.master.copy_(m)
            self._publish(g)
        self._finish_publish()
        self.optimizer.load_state_dict(optimizer_state)
