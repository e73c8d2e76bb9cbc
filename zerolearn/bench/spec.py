"""What one benchmark run is: ranks, rounds, steps, the model and the systems compared.

:class:`BenchSpec` is checked once, in the caller's process, before any rank starts
(:meth:`BenchSpec.check`); a bad value raises :class:`~zerolearn.errors.ConfigError`
naming the flag, and the command line exits 2. Every system trains the model and the
global batches of :meth:`BenchSpec.train_config`, the same ``TrainConfig`` that
``python -m zerolearn.train`` would run (fp32, Adam, no clipping).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass

import torch

from zerolearn.config import TrainConfig, check_output_file
from zerolearn.dist import DEFAULT_TIMEOUT_S
from zerolearn.errors import ConfigError, require_choice, require_count, require_real

ZEROLEARN = ("zerolearn-0", "zerolearn-1", "zerolearn-2", "zerolearn-3")
TORCH = ("ddp", "ddp-zero-optim", "fsdp2-no-reshard", "fsdp2-reshard")
DEEPSPEED = ("deepspeed-0", "deepspeed-1", "deepspeed-2", "deepspeed-3")
SYSTEMS = ZEROLEARN + TORCH + DEEPSPEED
FAMILIES = {"zerolearn": ZEROLEARN, "torch": TORCH, "deepspeed": DEEPSPEED}

STAGE = {**{n: s for s, n in enumerate(ZEROLEARN)}, **{n: s for s, n in enumerate(TORCH)},
         **{n: s for s, n in enumerate(DEEPSPEED)}}
"""The ZeRO stage (DeepSpeed's numbering) each system is compared at (paper Sec 5)."""

PEERS = {s: (TORCH[s], DEEPSPEED[s]) for s in range(4)}
"""Stage -> the peers zerolearn's stage is measured against: DDP / DeepSpeed-0; DDP with
``ZeroRedundancyOptimizer`` / DeepSpeed-1; FSDP2 keeping parameters gathered from forward
to backward / DeepSpeed-2; FSDP2 resharding after forward / DeepSpeed-3."""

PROG = "python -m zerolearn.bench"
DEEPSPEED_HINT = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed (or: make bench)"


def deepspeed_installed() -> bool:
    """Whether ``import deepspeed`` can work here (found, not imported: importing is slow)."""
    return importlib.util.find_spec("deepspeed") is not None


def parse_systems(text: str | None) -> tuple[str, ...]:
    """``--systems``: comma-separated names or families (zerolearn, torch, deepspeed), in
    :data:`SYSTEMS` order; None: every system, DeepSpeed's only when it is installed.

    Raises:
        ConfigError: an unknown name, none at all, or DeepSpeed asked for but not installed.
    """
    if text is None:
        return ZEROLEARN + TORCH + (DEEPSPEED if deepspeed_installed() else ())
    wanted = set()
    for item in (s.strip() for s in text.split(",")):
        require_choice("--systems", item, (*FAMILIES, *SYSTEMS))
        wanted.update(FAMILIES.get(item, (item,)))
    if wanted & set(DEEPSPEED) and not deepspeed_installed():
        raise ConfigError(f"--systems {text}: deepspeed is not installed; {DEEPSPEED_HINT}")
    return tuple(n for n in SYSTEMS if n in wanted)


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark: ``rounds`` rounds, each training every system for ``warmup`` +
    ``steps`` steps on ``world_size`` fresh ranks (:mod:`zerolearn.bench.harness`).

    Units: ``seq_len`` in tokens (bytes), ``global_batch_size`` in sequences over all
    ranks, ``bucket_mb`` in MiB (zerolearn's flat groups, DDP's ``bucket_cap_mb`` and
    DeepSpeed's reduce and all-gather buckets alike; None: each system's own default,
    zerolearn's 25 MiB buckets (the first 1 MiB on GPUs), DDP's a 1 MiB first one then
    25 MiB), ``timeout`` in seconds (what each system may take per round; a round's
    deadline is that times its systems).
    """

    world_size: int = 4
    rounds: int = 3
    warmup: int = 2
    steps: int = 5
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 64
    global_batch_size: int = 16
    lr: float = 1e-3
    bucket_mb: float | None = None
    seed: int = 0
    device: str = "cpu"
    timeout: float = DEFAULT_TIMEOUT_S
    systems: tuple[str, ...] = ZEROLEARN + TORCH

    @property
    def backend(self) -> str:
        """gloo on CPU, NCCL on CUDA."""
        return "nccl" if self.device == "cuda" else "gloo"

    def train_config(self, **changes) -> TrainConfig:
        """The run every system trains: model, batches, fp32 Adam, no clipping (``changes``
        override fields, e.g. ``stage``)."""
        return TrainConfig(d_model=self.d_model, n_layer=self.n_layer, n_head=self.n_head, seq_len=self.seq_len,
                           global_batch_size=self.global_batch_size, lr=self.lr, bucket_mb=self.bucket_mb,
                           seed=self.seed, steps=self.warmup + self.steps, backend=self.backend,
                           device=self.device, timeout=self.timeout, quiet=True, **changes)

    def replace(self, **changes) -> BenchSpec:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> BenchSpec:
        """Refuse what cannot run, before any rank starts; returns ``self``.

        Raises:
            ConfigError: counts < 1 (``warmup`` < 1: the first step allocates the
                optimizer's state and is never timed), an unknown system or device,
                CUDA asked for without CUDA or with more ranks than GPUs, and
                everything :meth:`TrainConfig.validate` refuses (a batch the world
                size does not divide, a width the heads do not divide).
        """
        for name in ("world_size", "rounds", "warmup", "steps"):
            require_count("--" + name.replace("_", "-"), getattr(self, name))
        require_real("--timeout", self.timeout)
        require_choice("--device", self.device, ("cpu", "cuda"))
        if not self.systems:
            raise ConfigError("--systems: name at least one system")
        for name in self.systems:
            require_choice("--systems", name, SYSTEMS)
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda: CUDA is not available on this machine; use --device cpu")
            if self.world_size > torch.cuda.device_count():
                raise ConfigError(f"--world-size {self.world_size} with --device cuda: NCCL needs one GPU per "
                                  f"rank and this machine has {torch.cuda.device_count()}")
        self.train_config().validate(self.world_size)
        return self


QUICK = {"rounds": 2, "warmup": 1, "steps": 3, "d_model": 64, "n_layer": 2}
"""``--quick``: what changes from :class:`BenchSpec`'s defaults (a few minutes on 2 cores)."""


def add_spec_options(p: argparse.ArgumentParser, defaults: BenchSpec) -> None:
    """The flags of :class:`BenchSpec` (defaults shown in ``--help``)."""
    d = defaults
    p.add_argument("--world-size", type=int, default=None,
                   help=f"ranks (default {d.world_size} on CPU, 1 with --device cuda)")
    p.add_argument("--rounds", type=int, default=None, help=f"rounds over all systems (default {d.rounds})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps per round (default {d.warmup})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per round (default {d.steps})")
    p.add_argument("--width", "--d-model", type=int, default=None, dest="d_model",
                   help=f"GPT d_model (default {d.d_model})")
    p.add_argument("--layers", "--n-layer", type=int, default=None, dest="n_layer",
                   help=f"GPT blocks (default {d.n_layer})")
    p.add_argument("--heads", "--n-head", type=int, default=None, dest="n_head",
                   help=f"attention heads (default {d.n_head})")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--batch", "--global-batch-size", type=int, default=None, dest="global_batch_size",
                   help=f"global batch, sequences (default {d.global_batch_size})")
    p.add_argument("--lr", type=float, default=None, help=f"Adam's learning rate (default {d.lr:g})")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="gradient bucket, MiB, for zerolearn, DDP and DeepSpeed (default: each system's own; "
                        "zerolearn's are 25 MiB, the first 1 MiB on GPUs; DDP's a 1 MiB first bucket, then 25 MiB)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one rank per GPU)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds each system may take per round; also the ranks' collective timeout "
                        f"(default {d.timeout:g})")
    p.add_argument("--quick", action="store_true",
                   help="a short run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", help="write the result here (JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def spec_from_args(args: argparse.Namespace, base: BenchSpec | None = None) -> BenchSpec:
    """``base`` (default :class:`BenchSpec`), then ``--quick``'s changes, then every flag given."""
    spec = base or BenchSpec()
    if args.quick:
        spec = spec.replace(**QUICK)
    given = {k: v for k, v in vars(args).items() if k in BenchSpec.__dataclass_fields__ and v is not None}
    if args.device == "cuda" and args.world_size is None:
        given["world_size"] = 1
    return spec.replace(**given)


def check_out(path: str | None) -> None:
    """Refuse an ``--out`` that cannot be written, before the run (ConfigError): a
    folder, a path ending in a separator, a missing or unreachable folder."""
    if path is None:
        return
    check_output_file("--out", path)
