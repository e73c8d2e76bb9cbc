"""ZeRO-R jobs for spawned gloo ranks: tensor parallelism, checkpointing, P_a, P_a+cpu."""

from __future__ import annotations

from jobs import LR, global_batch, gpt_loss, small_gpt
from zerolearn import comm, data
from zerolearn.engines import make_engine
from zerolearn.memory.ledger import MemoryLedger
from zerolearn.residual import buffers
from zerolearn.residual.checkpointing import CheckpointStore
from zerolearn.residual.tensor_parallel import make_parallel_groups, parallelize_gpt


def train_residual(stage: int = 0, nm: int = 1, checkpointing: bool = False, partition: bool = False,
                   cpu: bool = False, contiguous: bool = False, steps: int = 3,
                   optimizer: str = "sgd") -> dict:
    groups = make_parallel_groups(nm)
    model = parallelize_gpt(small_gpt(), groups)
    store = (CheckpointStore(partition=partition, cpu=cpu, contiguous=contiguous, group=groups.mp_group)
             if checkpointing else None)
    model.checkpoint_store = store
    engine = make_engine(stage, model, optimizer=optimizer, lr=LR[optimizer], bucket_mb=0.01,
                         group=groups.dp_group)
    comm.LEDGER.reset()
    losses, held, activations = [], None, None
    for step in range(steps):
        x, y = (data.rank_slice(t, groups.dp_rank, groups.nd) for t in global_batch(step))
        with MemoryLedger(record_timeline=False) as ledger:
            with ledger.phase("forward"):
                loss = gpt_loss(engine(x), y)
            activations = ledger.live["activations"]
            held = store.bytes_held() if store else (0, 0)
            engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(comm.monitor_mean(loss.item()))
    return {"losses": losses, "checkpoint_bytes": held, "activation_bytes": activations,
            "by_tag": comm.LEDGER.by_tag(), "gathered": store.gathered_elements if store else 0}


def many_residual(runs: list[dict]) -> list[dict]:
    return [train_residual(**kw) for kw in runs]


def fused_buffer_peak(stage: int, width: int, layers: int, bucket_mb: float) -> dict:
    """Largest fused communication buffer of one step of an MLP, bytes."""
    return buffers.fused_buffer_peak(stage, width, layers, bucket_mb)


