"""CB, constant-size fused buffers (paper Sec 6.2), measured.

Collectives run faster on one large buffer than on many small tensors, so gradients
are fused before they are reduced and parameters before they are gathered. Fusing
*everything* makes a buffer as large as the model: Sec 6.2's example is 12 GB of fp32
for 3B parameters. ZeRO caps the fused buffer at a constant size instead. Here the cap
is the engines' ``bucket_mb``: :func:`zerolearn.flat.make_buckets` cuts the flat
parameters into groups of at most that many bytes, and every fused buffer a
collective reads or writes is one group, so the largest one stays under the cap
however large the model grows (a single parameter larger than the cap is a group of
its own). :func:`fused_buffer_peak` measures it.
"""

from __future__ import annotations

import torch

from zerolearn.engines import make_engine
from zerolearn.models import build_model


def fused_buffer_peak(stage: int, width: int, layers: int = 6, bucket_mb: float = 0.25, seed: int = 0) -> dict:
    """Largest fused communication buffer of one training step of the seed MLP, on this process group.

    Builds the MLP (``layers`` square Linear layers of ``width``), runs one SGD step
    under stage ``stage`` with buckets of ``bucket_mb`` MiB (a cap at or above the
    model's size fuses everything), and returns ``{"peak": bytes, "psi": elements,
    "width", "bucket_mb"}``; ``peak`` is the engine's ``temp_buffer_peak_bytes``.
    """
    model = build_model("mlp", seed, mlp_width=width, mlp_layers=layers)
    engine = make_engine(stage, model, optimizer="sgd", lr=0.1, bucket_mb=bucket_mb)
    generator = torch.Generator().manual_seed(seed)
    engine.backward(engine(torch.randn(4, width, generator=generator)).pow(2).mean())
    engine.step()
    return {"peak": engine.temp_buffer_peak_bytes, "psi": engine.psi, "width": width, "bucket_mb": bucket_mb}
