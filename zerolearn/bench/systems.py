"""The systems the benchmark trains, one interface: forward and backward, step, bytes held.

Each system trains the same model (:func:`zerolearn.train.build` of the spec's
``TrainConfig``: same seed, same initial weights) on the same global batches with
fp32 Adam at the same learning rate, without clipping:

* ``zerolearn-S``: the package's stage S engine, built by :func:`zerolearn.train.setup`
  exactly as ``python -m zerolearn.train --stage S`` builds it;
* ``ddp``: ``DistributedDataParallel`` and ``torch.optim.Adam``;
* ``ddp-zero-optim``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (P_os over whole parameter tensors, not flat shards);
* ``fsdp2-reshard`` / ``fsdp2-no-reshard``: ``fully_shard`` on every unit of
  ``model.units()`` (the same units zerolearn's ZeRO-3 gathers: embedding, each block,
  head), then on the root, with ``reshard_after_forward`` True / False;
* ``deepspeed-S``: ``deepspeed.initialize`` at ZeRO stage S (torch's Adam inside).

DDP uses ``gradient_as_bucket_view=True``, so its gradients are its buckets and the
bytes measured from ``p.grad`` are all it holds for them (the default keeps a second
copy in its buckets). Buckets are ``bucket_mb`` for zerolearn, DDP and DeepSpeed's
stages 1-3 alike, each filled its own way: zerolearn's hold at most ``bucket_mb``
(a larger parameter alone), DDP's close once they reach it. DeepSpeed's stage 0 has
no bucket setting: it all-reduces every gradient after backward in flat buffers of up
to 5e8 elements, here one collective per step. FSDP2 reduces one unit at a time.

Bytes are measured from the tensors each system holds, each storage counted once
(Adam's scalar step counters left out, as :mod:`zerolearn.engines.optim` does): the
local shard of a DTensor (``to_local()``), ZeroRedundancyOptimizer's local optimizer,
DeepSpeed's partitions (``ds_tensor``) and its ZeRO optimizer's fp32 groups.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from zerolearn import compat
from zerolearn import dist as zdist
from zerolearn.chapters.ch07.lesson import DEEPSPEED_CONFIG
from zerolearn.config import TrainConfig
from zerolearn.memory.ledger import storage_bytes
from zerolearn.train import build, loss_fn, setup


def held_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` (DTensors: their local shard; None and
    0-d tensors skipped), each storage counted once across calls sharing ``seen``."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None)
    return storage_bytes([t for t in local if t.dim() > 0], seen)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class System:
    """One system on this rank. Subclasses set ``self.model`` (the module that runs
    forward) and implement :meth:`backward`, :meth:`step` and the byte counts."""

    def __init__(self, config: TrainConfig):
        self.config = config

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Loss of this rank's slice (a 0-d fp32 tensor), gradients reduced as the system does."""
        loss = loss_fn(self.config, self.model(x), y)
        self.backward(loss)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        raise NotImplementedError

    def grad_bytes(self) -> int:
        """Gradient bytes held after backward, before the step."""
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        """``params`` and ``optimizer_states`` bytes held after a step."""
        raise NotImplementedError


class ZeroLearn(System):
    """zerolearn's engine at ``config.stage``: bytes from ``Engine.model_state_bytes``."""

    def __init__(self, config: TrainConfig):
        super().__init__(config)
        self.run = setup(config)
        self.engine = self.model = self.run.engine

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()
        self.engine.zero_grad()

    def grad_bytes(self):
        return self.engine.model_state_bytes()["grads"]

    def state_bytes(self):
        held = self.engine.model_state_bytes()
        return {"params": held["params"], "optimizer_states": held["optimizer_states"]}


class TorchSystem(System):
    """DDP, DDP with ZeroRedundancyOptimizer, or FSDP2 (``kind``)."""

    def __init__(self, config: TrainConfig, kind: str):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(config)
        ctx = zdist.context()
        self.net = build(config).to(ctx.device)
        adam = {"lr": config.lr, "weight_decay": config.weight_decay}
        if kind.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh

            fully_shard = compat.fully_shard()
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
            reshard = kind == "fsdp2-reshard"
            for unit in self.net.units():
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
            self.model = fully_shard(self.net, mesh=mesh, reshard_after_forward=reshard)
            self.optimizer = torch.optim.Adam(self.net.parameters(), **adam)
        else:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.net, device_ids=ids, bucket_cap_mb=config.bucket_mb,
                                                 gradient_as_bucket_view=True)
            self.optimizer = (torch.optim.Adam(self.net.parameters(), **adam) if kind == "ddp" else
                              ZeroRedundancyOptimizer(self.net.parameters(), optimizer_class=torch.optim.Adam,
                                                      **adam))

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_bytes(self):
        return held_bytes([p.grad for p in self.net.parameters()], set())

    def state_bytes(self):
        seen: set[int] = set()
        inner = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer's local Adam
        return {"params": held_bytes(self.net.parameters(), seen),
                "optimizer_states": held_bytes(_state_tensors(inner), seen)}


class DeepSpeedSystem(System):
    """``deepspeed.initialize`` at ZeRO ``stage``, with the config of
    :func:`deepspeed_config`; joins the process group zerolearn made."""

    def __init__(self, config: TrainConfig, stage: int):
        ctx = zdist.context()
        # Read when deepspeed is first imported: which accelerator it drives.
        os.environ["DS_ACCELERATOR"] = "cuda" if ctx.device.type == "cuda" else "cpu"
        import deepspeed

        super().__init__(config)
        deepspeed.init_distributed(dist_backend=ctx.backend)
        net = build(config).to(ctx.device)
        self.model, self.zero_optimizer, _, _ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=deepspeed_config(config, stage, ctx.world_size))
        self.inner = getattr(self.zero_optimizer, "optimizer", self.zero_optimizer)  # torch's Adam

    def backward(self, loss):
        self.model.backward(loss)

    def step(self):
        self.model.step()  # zeroes the gradients too

    def _params(self) -> list[torch.Tensor]:
        return [getattr(p, "ds_tensor", p) for p in self.model.module.parameters()]  # stage 3: the partition

    def grad_bytes(self):
        # Autograd's .grad where DeepSpeed leaves it (stage 0), else the ZeRO optimizer's
        # own gradient buffers and partitions: its attributes named for gradients.
        seen: set[int] = set()
        held_bytes(self._params(), seen)  # parameters are not gradients, whatever holds them
        grads = [p.grad for p in self.model.module.parameters()]
        if self.zero_optimizer is not self.inner:
            grads += [t for name, value in vars(self.zero_optimizer).items()
                      if "grad" in name.lower() or "ipg" in name.lower() for t in _tensors_in(value)]
        return held_bytes(grads, seen)

    def state_bytes(self):
        seen: set[int] = set()
        params = held_bytes(self._params(), seen)
        # What the inner Adam steps, beyond the module's parameters, is the fp32 copy
        # the ZeRO optimizer keeps (its partition): an optimizer state, as our master is.
        stepped = [p for group in self.inner.param_groups for p in group["params"]]
        return {"params": params, "optimizer_states": held_bytes(stepped + _state_tensors(self.inner), seen)}


def _tensors_in(value, depth: int = 0) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    return []


def deepspeed_config(config: TrainConfig, stage: int, world_size: int) -> dict:
    """DeepSpeed's config for ``stage`` (chapter 7's ``DEEPSPEED_CONFIG``): fp32, torch's
    Adam with ``config.lr``, no clipping (DeepSpeed's default clips at 1.0), reduce and
    all-gather buckets (stages 1-3; stage 3's prefetch too) of ``config.bucket_mb`` MiB
    of fp32 elements (None: DeepSpeed's own defaults). Stage 0 takes no bucket size from
    the config."""
    zero = dict(DEEPSPEED_CONFIG[stage]["zero_optimization"])
    bucket = None if config.bucket_mb is None else int(config.bucket_mb * 2**20 / 4)
    if stage > 0 and bucket is not None:
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    if stage == 3 and bucket is not None:
        zero.update(stage3_prefetch_bucket_size=bucket)
    return {"train_micro_batch_size_per_gpu": config.global_batch_size // world_size,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": config.lr, "torch_adam": True, "adam_w_mode": False,
                                                     "weight_decay": config.weight_decay}},
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_optimization": zero}


def build_system(name: str, config: TrainConfig) -> System:
    """The system ``name`` (:data:`zerolearn.bench.spec.SYSTEMS`) on the current process group."""
    if name.startswith("zerolearn-"):
        return ZeroLearn(config.replace(stage=int(name[-1])))
    if name.startswith("deepspeed-"):
        return DeepSpeedSystem(config, int(name[-1]))
    return TorchSystem(config, name)


def count_params(config: TrainConfig) -> int:
    """Psi: trainable parameters of the model (unpadded)."""
    model: nn.Module = build(config)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
