"""ZeRO-R for the training CLI: options, checks, and the per-rank report entry."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerolearn.errors import ConfigError
from zerolearn.memory import model as analytic
from zerolearn.residual import defrag
from zerolearn.residual.checkpointing import CheckpointStore
from zerolearn.residual.tensor_parallel import ParallelGroups, make_parallel_groups, parallelize_gpt


def add_options(p: argparse.ArgumentParser) -> None:
    """The ZeRO-R options of DESIGN section 4."""
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="keep one checkpoint per transformer block, recompute in backward (Sec 3.2)")
    p.add_argument("--partition-activations", action="store_true",
                   help="P_a: split each checkpoint across the tensor-parallel ranks (Sec 6.1)")
    p.add_argument("--cpu-checkpointing", action="store_true", help="P_a+cpu: keep checkpoints in host memory")
    p.add_argument("--contiguous-checkpoints", action="store_true",
                   help="MD: copy checkpoints into one pre-allocated pool (Sec 6.3)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="NM",
                   help="split each GPT block across NM ranks (Megatron-style); world = Nd x NM")


def validate(args: argparse.Namespace, world_size: int) -> int:
    """Check the ZeRO-R options; return Nd, the data-parallel degree.

    Raises:
        ConfigError: an option that needs another one, or an Nm the world or model cannot take.
    """
    needs = {"--partition-activations": args.partition_activations, "--cpu-checkpointing": args.cpu_checkpointing,
             "--contiguous-checkpoints": args.contiguous_checkpoints}
    for name, on in needs.items():
        if on and not args.checkpoint_activations:
            raise ConfigError(f"{name} needs --checkpoint-activations (it changes where checkpoints live)")
    nm = args.tensor_parallel
    if nm < 1 or world_size % nm:
        raise ConfigError(f"--tensor-parallel {nm}: must be >= 1 and divide the world size {world_size}")
    if (nm > 1 or args.checkpoint_activations) and args.model != "gpt":
        raise ConfigError("--tensor-parallel and --checkpoint-activations apply to --model gpt")
    if nm > 1 and args.n_head % nm:
        raise ConfigError(f"--tensor-parallel {nm}: must divide --n-head {args.n_head}")
    return world_size // nm


@dataclass
class Residual:
    """What ZeRO-R set up on this rank: groups, the checkpoint store (or None)."""

    groups: ParallelGroups
    store: CheckpointStore | None


def apply(args: argparse.Namespace, model: nn.Module) -> Residual:
    """Split the model for tensor parallelism and attach the checkpoint store (a collective)."""
    if args.tensor_parallel > 1:
        groups = make_parallel_groups(args.tensor_parallel)
        parallelize_gpt(model, groups)
    else:
        groups = ParallelGroups(dist.get_world_size(), 1, dist.get_rank(), 0, None, None)
    store = None
    if args.checkpoint_activations:
        store = CheckpointStore(partition=args.partition_activations, cpu=args.cpu_checkpointing,
                                contiguous=args.contiguous_checkpoints, group=groups.tp_group)
        model.checkpoint_store = store
    return Residual(groups, store)


def report_entry(residual: Residual, held: tuple[int, int], temp_buffer_peak: int, activations: int,
                 device: torch.device | None = None) -> dict:
    """The per-rank ``residual`` entry of the report (DESIGN section 4).

    On a CUDA ``device`` it also holds ``fragmentation``: torch's allocator statistics
    over the run (``defrag.cuda_fragmentation``: allocated, reserved and
    inactive-split bytes, Sec 6.3).
    """
    store = residual.store
    entry = {"checkpoint_bytes_device": held[0], "checkpoint_bytes_host": held[1],
             "temp_buffer_peak_bytes": temp_buffer_peak, "activation_bytes_end_of_forward": activations,
             "transfer_seconds": store.transfer_seconds if store else 0.0,
             "pa_allgather_elements": store.gathered_elements if store else 0}
    if device is not None and device.type == "cuda":
        entry["fragmentation"] = defrag.cuda_fragmentation(torch.cuda.memory_stats(device))
    return entry


def analytic_entry(args: argparse.Namespace, nd: int) -> dict:
    """The paper's numbers for this run's residual states (Sec 3.2, Sec 6.1, Sec 8)."""
    local_batch = args.global_batch_size // nd // args.grad_accum_steps
    width = analytic.dtype_bytes(args.dtype)
    checkpoints = (analytic.activation_bytes(args.d_model, local_batch, args.seq_len, args.n_layer,
                                             bytes_per_value=width, checkpointing=True)
                   if args.checkpoint_activations else 0)
    if args.partition_activations:
        checkpoints = analytic.partitioned_checkpoint_bytes(args.d_model, local_batch, args.seq_len, args.n_layer,
                                                            nm=args.tensor_parallel, bytes_per_value=width)
    return {"checkpoint_bytes": checkpoints,
            "pa_overhead_ratio": analytic.pa_overhead_ratio(args.seq_len, local_batch, args.d_model)}
