"""TrainConfig: every option of a training run, checked in one place.

One frozen dataclass serves both ways in: Python builds it directly, and the command
line (``python -m zerolearn.train --stage 2 ...``) parses into it, every field a flag
of the same name (``global_batch_size`` is ``--global-batch-size``)::

    config = TrainConfig(stage=2, steps=20, dtype="bf16")
    launch(train, 4, config)                    # zerolearn.train.train on 4 gloo ranks
    launch(train, 4, config.replace(stage=3))   # the same run at ZeRO-3

Checks happen in two places, both raising :class:`ConfigError` naming the option and
what is allowed, before any work starts:

* at construction (``__post_init__``): choices, counts >= 1, finite positive reals,
  options that need another one, the width the heads divide, the corpus length; a
  misspelled field is a ``TypeError`` from the dataclass, in the caller's process;
* :meth:`TrainConfig.validate` with the world size, on every rank before training:
  batch divisibility by Nd x K, ``fail_rank``, Nm and the node size dividing the world, output paths,
  the batch fitting this machine's memory, CUDA-only options.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from zerolearn import data
from zerolearn.dist import DEFAULT_TIMEOUT_S, resolve_backend_device
from zerolearn.engines.offload import OFFLOADS
from zerolearn.engines.optim import OPTIMIZERS
from zerolearn.errors import ConfigError, require_choice, require_count, require_real
from zerolearn.memory import model as analytic
from zerolearn.models import MODELS, GPTConfig
from zerolearn.precision import DTYPES
from zerolearn.zeropp import DEFAULT_BLOCK


def _opt(default, help: str, **argparse_kw):
    """A field with its command-line help (and argparse extras: choices, metavar)."""
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass(frozen=True)
class TrainConfig:
    """One training run: model, data, optimizer, stage, ZeRO-R, offload, ZeRO++, checkpoints, testing hooks.

    Units: ``bucket_mb``, ``prefetch_mb`` and ``cb_mb`` in MiB, ``timeout`` in seconds, ``seq_len`` in
    tokens (bytes of the corpus), ``global_batch_size`` in sequences (GPT) or rows (MLP)
    over all ranks, ``node_size`` in ranks, ``qwz_block`` in elements per fp32 scale. Stage
    numbers follow DeepSpeed: 0 DP, 1 P_os, 2 P_os+g, 3 P_os+g+p (paper Sec 5). ZeRO++ (qwZ,
    hpZ, qgZ: Wang et al., arXiv 2306.10209 Sec 3) applies to stage 3.

    Raises:
        ConfigError: a value outside what is allowed (the message names the option as
            its flag, e.g. ``--steps 0: must be >= 1``).
        TypeError: a field name that does not exist.
    """

    stage: int = _opt(0, "0 DP, 1 P_os, 2 P_os+g, 3 P_os+g+p", choices=range(4))
    model: str = _opt("gpt", "the model: a small GPT or the seed experiment's MLP", choices=MODELS)
    steps: int = _opt(10, "optimizer steps of the whole run (a resumed run runs the rest)")
    global_batch_size: int = _opt(16, "sequences (or rows) per step, all ranks")
    seq_len: int = _opt(64, "GPT context length, bytes")
    dtype: str = _opt("fp32", "training precision (bf16/fp16 keep fp32 master weights)", choices=tuple(DTYPES))
    optimizer: str = _opt("adam", "the optimizer", choices=OPTIMIZERS)
    lr: float = _opt(1e-3, "learning rate")
    momentum: float = _opt(0.0, "SGD momentum (0: plain SGD, K=0 in fp32)")
    weight_decay: float = _opt(0.0, "weight decay")
    max_grad_norm: float | None = _opt(None, "clip the global gradient norm")
    seed: int = _opt(0, "model initialisation and data order")
    bucket_mb: float | None = _opt(None, "gradient bucket size, MiB (default: 25 MiB buckets, the first 1 MiB on "
                                         "GPUs as torch DDP makes it)")
    prefetch_mb: float | None = _opt(None, "stage 3: the most MiB of small units one prefetch gathers, in one "
                                           "all_gather (default 4; 0: one unit at a time)")
    grad_accum_steps: int = _opt(1, "micro-batches per step")
    n_layer: int = _opt(2, "GPT transformer blocks")
    d_model: int = _opt(64, "GPT width")
    n_head: int = _opt(4, "GPT attention heads")
    mlp_width: int = _opt(256, "MLP width (the seed experiment: 10000)")
    mlp_layers: int = _opt(6, "MLP layers")
    backend: str = _opt("auto", "auto, gloo or nccl")
    device: str = _opt("auto", "auto, cpu or cuda")
    timeout: float = _opt(DEFAULT_TIMEOUT_S, "collective timeout, s")
    simulate_world_size: int | None = _opt(
        None, "run rank 0 of N ranks in this process (fake process group): real shards and bytes, no data "
              "moved, losses not meaningful", metavar="N")
    memory_timeline: bool = _opt(False, "add the last step's memory timeline to the report")
    cuda_memory_snapshot: str | None = _opt(
        None, "CUDA: record every allocation of the run and write torch's memory snapshot (open it at "
              "pytorch.org/memory_viz); one file per rank: FILE with _rankR added", metavar="FILE")
    checkpoint_dir: str | None = _opt(None, "save sharded checkpoints here; resume from the newest complete one",
                                      metavar="D")
    checkpoint_every: int = _opt(0, "save every K steps (0: only at the end); needs --checkpoint-dir", metavar="K")
    checkpoint_keep: int = _opt(2, "complete checkpoints kept (0: all)")
    loss_scale_window: int = _opt(1000, "fp16: clean steps after which the loss scale doubles")
    debug_collectives: bool = _opt(False, "debug mode: before every collective, check that all ranks are about to "
                                          "run the same one; at ZeRO-3 also the units each rank runs and computes "
                                          "gradients for, and every read of a parameter (also "
                                          "ZEROLEARN_DEBUG_COLLECTIVES=1)")
    fail_at_step: int | None = _opt(None, "testing: --fail-rank fails during step K, on the first attempt only",
                                    metavar="K")
    fail_rank: int = _opt(0, "testing: the rank that fails")
    fail_mode: str = _opt("kill", "testing: SIGKILL itself, or stop responding", choices=("kill", "hang"))
    # ZeRO-R (paper Sec 6); the report: docs/ARCHITECTURE.md.
    checkpoint_activations: bool = _opt(False, "keep one checkpoint per transformer block, recompute in backward "
                                               "(Sec 3.2)")
    partition_activations: bool = _opt(False, "P_a: split each checkpoint across the tensor-parallel ranks "
                                              "(Sec 6.1)")
    cpu_checkpointing: bool = _opt(False, "P_a+cpu: keep checkpoints in host memory")
    contiguous_checkpoints: bool = _opt(False, "MD: copy checkpoints into one pre-allocated pool (Sec 6.3)")
    tensor_parallel: int = _opt(1, "split each GPT block across NM ranks (Megatron-style); world = Nd x NM",
                                metavar="NM")
    # ZeRO-Offload (arXiv 2101.06840) and ZeRO-Infinity (arXiv 2104.07857): zerolearn.engines.offload.
    offload: str | None = _opt(None, "stages 1-3: fp32 master, moments and gradient shard in host memory, the "
                                     "optimizer step on the CPU (cpu), and the optimizer states in files (disk)",
                               choices=OFFLOADS)
    offload_dir: str | None = _opt(None, "--offload disk: folder of the files (default: a temporary one)",
                                   metavar="D")
    dpu: bool = _opt(False, "with --offload: one-step delayed parameter update, the host step overlaps the next "
                            "forward and backward")
    # ZeRO++ (Wang et al., arXiv 2306.10209, Sec 3): zerolearn.zeropp, zerolearn.engines.zeropp_units.
    node_size: int | None = _opt(None, "ranks per node (consecutive global ranks; must divide the world size): the "
                                       "report splits each rank's bytes intra / inter node", metavar="K")
    qwz: bool = _opt(False, "stage 3, ZeRO++ qwZ (Sec 3.1): weight all_gathers in int8, one fp32 scale per "
                            "--qwz-block elements")
    qwz_block: int = _opt(DEFAULT_BLOCK, "with --qwz: elements per fp32 scale of the int8 weights (and of --qgz's "
                                         "int4 gradients)", metavar="B")
    hpz: bool = _opt(False, "stage 3, ZeRO++ hpZ (Sec 3.2): a secondary shard per node, backward's gathers stay "
                            "inside the node; needs --node-size")
    qgz: bool = _opt(False, "stage 3, ZeRO++ qgZ (Sec 3.3): gradients reduced by an int4 all-to-all in two hops, "
                            "inside the node then across; needs --node-size")
    report: str | None = _opt(None, "write the JSON report here (rank 0)")
    quiet: bool = _opt(False, "no progress bar")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_numbers(self)
        _check_needs(self)

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes`` (field=value), checked like a new one."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """Every field by name (the report's ``config``, checkpoints' saved config)."""
        return dataclasses.asdict(self)

    def validate(self, world_size: int) -> int:
        """The checks that need the world size or this machine; return Nd (world / Nm).

        Raises:
            ConfigError: batch not divisible by Nd x K, Nm or ``node_size`` not dividing the world,
                ``fail_rank`` outside the world, an output path that cannot be
                written, a batch larger than this machine's free memory, a CUDA-only
                option on CPU.
        """
        _check_paths(self)
        if self.fail_at_step is not None and not 0 <= self.fail_rank < world_size:
            raise ConfigError(f"--fail-rank {self.fail_rank}: allowed are 0 to {world_size - 1} "
                              f"(world size {world_size})")
        if self.node_size is not None and world_size % self.node_size:
            divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(f"--node-size {self.node_size}: must divide the world size {world_size} (every node "
                              f"holds the same number of ranks); allowed are {divisors}")
        nm = self.tensor_parallel
        if world_size % nm:
            raise ConfigError(f"--tensor-parallel {nm}: must be >= 1 and divide the world size {world_size}")
        nd = world_size // nm
        if self.global_batch_size % (nd * self.grad_accum_steps):
            ranks = f"world size {world_size}" if nd == world_size else f"Nd = {nd} data-parallel groups"
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by {ranks} x --grad-accum-steps "
                f"{self.grad_accum_steps}; allowed are multiples of {nd * self.grad_accum_steps}")
        _check_batch_fits(self, nd)
        _, device = resolve_backend_device(self.backend, self.device)
        if self.cuda_memory_snapshot and device != "cuda":
            raise ConfigError(f"--cuda-memory-snapshot {self.cuda_memory_snapshot}: needs a CUDA device; this run "
                              f"is on {device} (on CPU, --memory-timeline records the step instead)")
        return nd

    def to_argv(self) -> list[str]:
        """The command-line options of this run (fields that differ from their default), so
        that ``TrainConfig.from_argv(config.to_argv()) == config``; for torchrun scripts."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                flag = _flag(f.name)
                argv += [flag] if value is True else [flag, str(value)]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> TrainConfig:
        """Parse command-line options (``sys.argv[1:]`` if None); exits 2 on bad ones, as argparse does."""
        parser = build_parser()
        try:
            return cls(**vars(parser.parse_args(argv)))
        except ConfigError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")


def build_parser(prog: str = "python -m zerolearn.train") -> argparse.ArgumentParser:
    """The command line of :class:`TrainConfig`: one flag per field, its help and choices."""
    p = argparse.ArgumentParser(prog=prog, description="Train one model at one ZeRO stage on this process group.")
    for f in dataclasses.fields(TrainConfig):
        flag, extra = _flag(f.name), dict(f.metadata)
        if f.default is False:
            p.add_argument(flag, action="store_true", **extra)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        p.add_argument(flag, type=kind, default=f.default, **extra)
    return p


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_choices(c: TrainConfig) -> None:
    allowed = {"stage": range(4), "model": MODELS, "dtype": tuple(DTYPES), "optimizer": OPTIMIZERS,
               "fail_mode": ("kill", "hang")}
    for name, choices in allowed.items():
        require_choice(_flag(name), getattr(c, name), choices)
    if c.offload is not None:
        require_choice("--offload", c.offload, OFFLOADS)


SEED_MAX = 2**32 - 1  # the seed of step s's batch is seed x 1_000_003 + s, a 64-bit generator seed
COUNT_MAX = 2**63 - 1  # every count fits the 64-bit integers torch and the OS take
TIMEOUT_MAX = 2**31 - 1  # seconds: torch's collective timeouts are C ints of seconds


def _check_upper(name: str, value, high) -> None:
    if value is not None and value > high:
        raise ConfigError(f"{_flag(name)} {value}: too large; allowed are up to {high}")


def _check_numbers(c: TrainConfig) -> None:
    """Counts >= 1 (and in 64 bits), finite positive reals, a width the heads divide, a
    sequence the corpus holds."""
    for name in ("steps", "global_batch_size", "seq_len", "grad_accum_steps", "loss_scale_window", "n_layer",
                 "d_model", "n_head", "mlp_width", "mlp_layers", "tensor_parallel", "seed", "qwz_block"):
        require_count(_flag(name), getattr(c, name), minimum=0 if name == "seed" else 1)
    for name in ("checkpoint_every", "checkpoint_keep", "fail_rank"):
        require_count(_flag(name), getattr(c, name), minimum=0)
    for name in ("simulate_world_size", "fail_at_step", "node_size"):
        if getattr(c, name) is not None:
            require_count(_flag(name), getattr(c, name), minimum=0 if name == "fail_at_step" else 1)
    for name in ("lr", "timeout", "bucket_mb", "max_grad_norm"):
        if getattr(c, name) is not None:
            require_real(_flag(name), getattr(c, name))
    for name in ("momentum", "weight_decay", "prefetch_mb"):
        if getattr(c, name) is not None:
            require_real(_flag(name), getattr(c, name), strict=False)
    for f in dataclasses.fields(c):
        if isinstance(getattr(c, f.name), int) and not isinstance(getattr(c, f.name), bool):
            _check_upper(f.name, getattr(c, f.name), SEED_MAX if f.name == "seed" else COUNT_MAX)
    _check_upper("timeout", c.timeout, TIMEOUT_MAX)
    if c.model == "gpt" and c.d_model % c.n_head:
        raise ConfigError(f"--d-model {c.d_model} is not divisible by --n-head {c.n_head}; allowed are head "
                          f"counts that divide the width")
    longest = int(0.9 * len(data.corpus())) - 2  # the training split (data.gpt_batch)
    if c.model == "gpt" and c.seq_len > longest:
        raise ConfigError(f"--seq-len {c.seq_len}: longer than the training corpus; allowed are 1 to {longest}")


def _check_needs(c: TrainConfig) -> None:
    """Options that need another option, or exclude one."""
    if c.checkpoint_every and not c.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir")
    if c.checkpoint_dir and c.tensor_parallel > 1:
        raise ConfigError(f"--checkpoint-dir with --tensor-parallel {c.tensor_parallel}: checkpoints hold "
                          "data-parallel shards of whole layers; tensor-parallel slices are not saved (allowed: "
                          "--tensor-parallel 1 with checkpoints)")
    if c.checkpoint_dir and c.simulate_world_size:
        raise ConfigError("--checkpoint-dir with --simulate-world-size: only rank 0 exists, there is "
                          "nothing whole to save")
    for name in ("partition_activations", "cpu_checkpointing", "contiguous_checkpoints"):
        if getattr(c, name) and not c.checkpoint_activations:
            raise ConfigError(f"{_flag(name)} needs --checkpoint-activations (it changes where "
                              "checkpoints live)")
    if (c.tensor_parallel > 1 or c.checkpoint_activations) and c.model != "gpt":
        raise ConfigError("--tensor-parallel and --checkpoint-activations apply to --model gpt")
    if c.tensor_parallel > 1 and c.n_head % c.tensor_parallel:
        raise ConfigError(f"--tensor-parallel {c.tensor_parallel}: must divide --n-head {c.n_head}")
    if c.offload is not None and c.stage == 0:
        raise ConfigError(f"--offload {c.offload} with --stage 0: allowed at stages 1, 2, 3 (ZeRO-Offload moves "
                          "the partitioned optimizer states; stage 0 partitions nothing)")
    if c.dpu and c.offload is None:
        raise ConfigError("--dpu needs --offload cpu or --offload disk")
    if c.offload_dir is not None and c.offload != "disk":
        raise ConfigError(f"--offload-dir {c.offload_dir} needs --offload disk")
    _check_zeropp(c)


def _check_zeropp(c: TrainConfig) -> None:
    """ZeRO++'s options (arXiv 2306.10209 Sec 3) as the stage-3 engine takes them
    (:class:`zerolearn.engines.zeropp_units.ZeroPP`): stage 3 only, hpZ and qgZ per node,
    nodes cut from every rank of the job (not from a tensor-parallel run's data-parallel
    group), a block size only where qwZ uses it."""
    used = [_flag(name) for name in ("qwz", "hpz", "qgz") if getattr(c, name)]
    if used and c.stage != 3:
        raise ConfigError(f"{' '.join(used)} with --stage {c.stage}: ZeRO++ options apply to --stage 3 only "
                          "(they change ZeRO-3's parameter gathers and gradient reduce_scatter)")
    for flag in ("--hpz", "--qgz"):
        if flag in used and c.node_size is None:
            raise ConfigError(f"{flag} needs --node-size K (ranks per node, dividing the world size): ZeRO++'s "
                              f"{flag[2:]} works per node")
        if flag in used and c.tensor_parallel > 1:
            raise ConfigError(f"{flag} with --tensor-parallel {c.tensor_parallel}: ZeRO++'s nodes are cut from "
                              "all ranks of the job, the engine's group is one data-parallel group (allowed: "
                              "--tensor-parallel 1)")
    if c.qwz_block != DEFAULT_BLOCK and not c.qwz:
        raise ConfigError(f"--qwz-block {c.qwz_block} needs --qwz (without it qgZ quantizes with blocks of "
                          f"{DEFAULT_BLOCK})")


def _check_paths(c: TrainConfig) -> None:
    """Output paths that training would only fail on at its end are checked first."""
    if c.report:
        check_output_file("--report", c.report)
    if c.checkpoint_dir:
        check_output_folder("--checkpoint-dir", c.checkpoint_dir)
    if c.offload_dir:
        check_output_folder("--offload-dir", c.offload_dir)


def check_output_file(option: str, path: str) -> None:
    """Refuse an output file ``path`` (given as ``option``) before any work.

    It must name a file (not a folder, not ending in a path separator) whose folder
    exists and is writable. A path that cannot be reached (a loop of symbolic links,
    a component that is a file, no permission) is refused naming the reason.

    Raises:
        ConfigError: naming ``option``, ``path`` and what is wrong.
    """
    where = f"{option} {path}"
    if not path or path.endswith((os.sep, "/")):
        raise ConfigError(f"{where}: ends in a path separator; give a file name (e.g. run.json)")
    _reachable(path, where)
    parent = os.path.dirname(os.path.realpath(path))
    _reachable(parent, where)
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"{where}: cannot write a file there (the folder must exist and be writable)")


def check_output_folder(option: str, path: str) -> None:
    """Refuse an output folder ``path`` (given as ``option``; created if missing) before any work.

    It must be a writable folder, or a path whose nearest existing folder is
    writable; a path that cannot be reached is refused naming the reason.

    Raises:
        ConfigError: naming ``option``, ``path`` and what is wrong.
    """
    where = f"{option} {path}"
    if not path:
        raise ConfigError(f"{where}: empty; give a folder")
    d = os.path.abspath(path)
    while not _reachable(d, where):  # the nearest folder that exists must be writable
        if os.path.islink(d):
            raise ConfigError(f"{where}: {d} is a symbolic link to nothing")
        d = os.path.dirname(d)
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise ConfigError(f"{where}: not a writable folder ({d})")


def _reachable(path: str, where: str) -> bool:
    """Whether ``path`` exists (False: it does not, yet); ConfigError if it cannot be reached."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:  # ELOOP, ENOTDIR, EACCES, ENAMETOOLONG, ...
        raise ConfigError(f"{where}: cannot be reached ({e.strerror}: {path})") from None
    except ValueError as e:  # an embedded NUL byte
        raise ConfigError(f"{where}: not a path ({e})") from None
    return True


def micro_batch(c: TrainConfig, nd: int) -> int:
    """Samples per micro-batch on one data-parallel rank: global / (Nd x K), at least 1."""
    return max(c.global_batch_size // (nd * c.grad_accum_steps), 1)


def step_bytes_lower_bound(c: TrainConfig, nd: int) -> int:
    """Bytes one training step needs at the least on each rank, beyond the model.

    Every rank makes the whole global batch and keeps its share: GPT tokens and
    targets as int64 (2 x global batch x seq_len x 8 bytes), MLP inputs and targets
    as fp32 (global batch x width x 4 x 2). A micro-batch of ``global / (Nd x K)``
    samples (K = grad_accum_steps) then keeps its fp32 activations: for the GPT
    12 x b x s x h per block, b x s x h with checkpointing (Sec 3.2,
    ``memory.model.activation_bytes``) plus logits and their gradient (2 x b x s x
    vocab); for the MLP its width per layer, twice. An estimate from below: a step
    that needs more than this will not run where this does not fit.
    """
    micro = micro_batch(c, nd)
    if c.model == "gpt":
        batch = 2 * c.global_batch_size * c.seq_len * 8
        acts = analytic.activation_bytes(c.d_model, micro, c.seq_len, c.n_layer, bytes_per_value=4,
                                         checkpointing=c.checkpoint_activations)
        return batch + acts + 2 * micro * c.seq_len * GPTConfig.vocab_size * 4
    return 2 * c.global_batch_size * c.mlp_width * 4 + 2 * micro * c.mlp_width * c.mlp_layers * 4


def _check_batch_fits(c: TrainConfig, nd: int) -> None:
    """Refuse a batch that cannot fit in this machine's memory, before allocating it
    (too large a batch otherwise ends in an allocator abort or the kernel's OOM killer)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not every platform says
        return
    need = step_bytes_lower_bound(c, nd)
    if need > free:
        raise ConfigError(
            f"--global-batch-size {c.global_batch_size}: one step needs at least {need / 2**30:.1f} GiB on each "
            f"rank (the batch, and the activations of a micro-batch of {micro_batch(c, nd)}), more than the "
            f"{free / 2**30:.1f} GiB of memory free here; allowed: a smaller --global-batch-size (more "
            f"--grad-accum-steps shrinks the activations, not the batch)")
