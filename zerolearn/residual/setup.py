"""ZeRO-R for the training loop: set up groups and the checkpoint store, and the report entries.

The options and their checks are fields of :class:`zerolearn.config.TrainConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerolearn.config import micro_batch
from zerolearn.memory import model as analytic
from zerolearn.residual import defrag
from zerolearn.residual.checkpointing import CheckpointStore
from zerolearn.residual.tensor_parallel import ParallelGroups, make_parallel_groups, parallelize_gpt


@dataclass
class Residual:
    """What ZeRO-R set up on this rank: groups, the checkpoint store (or None)."""

    groups: ParallelGroups
    store: CheckpointStore | None


def apply(config, model: nn.Module) -> Residual:
    """Split the model for tensor parallelism and attach the checkpoint store (a collective)."""
    if config.tensor_parallel > 1:
        groups = make_parallel_groups(config.tensor_parallel)
        parallelize_gpt(model, groups)
    else:
        groups = ParallelGroups(dist.get_world_size(), 1, dist.get_rank(), 0, None, None)
    store = None
    if config.checkpoint_activations:
        store = CheckpointStore(partition=config.partition_activations, cpu=config.cpu_checkpointing,
                                contiguous=config.contiguous_checkpoints, group=groups.mp_group)
        model.checkpoint_store = store
    return Residual(groups, store)


def report_entry(residual: Residual, held: tuple[int, int], temp_buffer_peak: int, activations: int,
                 device: torch.device | None = None) -> dict:
    """The per-rank ``residual`` entry of the report (docs/ARCHITECTURE.md, "The training run").

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


def analytic_entry(config, nd: int) -> dict:
    """The paper's numbers for this run's residual states (Sec 3.2, Sec 6.1, Sec 8)."""
    local_batch = micro_batch(config, nd)
    width = analytic.dtype_bytes(config.dtype)
    checkpoints = (analytic.activation_bytes(config.d_model, local_batch, config.seq_len, config.n_layer,
                                             bytes_per_value=width, checkpointing=True)
                   if config.checkpoint_activations else 0)
    if config.partition_activations:
        checkpoints = analytic.partitioned_checkpoint_bytes(config.d_model, local_batch, config.seq_len, config.n_layer,
                                                            nm=config.tensor_parallel, bytes_per_value=width)
    return {"checkpoint_bytes": checkpoints,
            "pa_overhead_ratio": analytic.pa_overhead_ratio(config.seq_len, local_batch, config.d_model)}
