"""Chapter 3, ZeRO-2 (P_os+g): gradient accumulation written two ways, measured.

The chapter writes the blog's flawed ZeRO-2 (``BlogZero2``, on chapter 2's
:class:`zerolearn.chapters.ch02.lesson.NaiveZero1`) in its own cells. What stays here
is :func:`accumulation_tradeoff`, run on spawned ranks: ZeRO-2 with a backward per
micro-batch (a reduce-scatter each, only the shard kept) against ``engine.no_sync()``
(one reduce-scatter per step, the whole gradient kept until then).
"""

from __future__ import annotations

import torch.nn.functional as F

from zerolearn import comm


def accumulation_tradeoff(micro_batches: int = 4, steps: int = 2) -> dict[str, dict]:
    """ZeRO-2 with gradient accumulation written two ways, on this process group.

    ``"backward each micro-batch"``: plain ``engine.backward`` per micro-batch, so each
    one is reduce-scattered at once and added into the rank's shard; ``"no_sync"``:
    the first micro-batches inside ``engine.no_sync()``, so gradients add up locally
    and only the last backward reduces. The package's GPT (d 64, 2 blocks, sequence
    32), a global batch of 16 sequences, fp32 Adam, buckets of 0.05 MiB.

    Returns per way: ``losses`` (global mean per step), ``reduce_scatter_calls`` and
    ``reduce_scatter_elements`` per step, ``peak_grad_bytes`` (most gradient bytes
    held at once, measured), ``psi``.
    """
    from zerolearn import data
    from zerolearn import dist as zdist
    from zerolearn.engines import make_engine
    from zerolearn.models import GPTConfig, build_model

    ctx, gpt = zdist.context(), GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
    out = {}
    for way in ("backward each micro-batch", "no_sync"):
        engine = make_engine(2, build_model("gpt", 0, gpt=gpt), optimizer="adam", lr=1e-3, bucket_mb=0.05)
        comm.LEDGER.reset()
        losses = []
        for step in range(steps):
            x, y = (data.rank_slice(t, ctx.rank, ctx.world_size) for t in data.gpt_batch(step, 16, gpt.seq_len))
            local = 0.0
            for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
                loss = F.cross_entropy(engine(xm).float().flatten(0, 1), ym.flatten()) / micro_batches
                if way == "no_sync" and i < micro_batches - 1:
                    with engine.no_sync():
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                local += loss.item()
            engine.step()
            engine.zero_grad()
            losses.append(comm.monitor_mean(local))
        rs = comm.LEDGER.as_dict()["reduce_scatter"]
        out[way] = {"losses": losses, "reduce_scatter_calls": rs["calls"] // steps,
                    "reduce_scatter_elements": rs["elements"] // steps,
                    "peak_grad_bytes": engine.peak_grad_bytes, "psi": engine.psi}
    return out

