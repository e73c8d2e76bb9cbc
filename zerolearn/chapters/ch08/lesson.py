"""Chapter 8, beyond the paper: what the chapter runs besides the engines' own tables.

* :func:`dpu_loss_curves` trains one GPT twice in this process with its optimizer step
  "offloaded" to a host worker thread: once synchronously, once with ZeRO-Offload's
  one-step delayed parameter update (Ren et al., USENIX ATC 2021, arXiv 2101.06840),
  driven by the chapter's exercise solution :func:`~zerolearn.chapters.ch08.dpu_step.dpu_step`
  on a real ``ThreadPoolExecutor``. Same model, batches and Adam: the loss curves show
  what one step of staleness costs.
* :func:`quantization_errors` measures qwZ's and qgZ's error (Wang et al., arXiv
  2306.10209) on a GPT's parameters and gradients with :mod:`zerolearn.zeropp`'s
  block quantizer, beside one scale for the whole tensor.

The measured memory and traffic tables of the offload and ZeRO++ engines are
:func:`zerolearn.experiments.offload.offload_table` and
:func:`zerolearn.experiments.zeropp.zeropp_table`; the chapter prints them beside the
formulas. The chapter's exercises (``08.dpu_step``, ``08.quantized_all_gather``) are
beside this module, in :mod:`zerolearn.chapters.ch08`.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from zerolearn import data
from zerolearn.chapters.ch08.dpu_step import dpu_step
from zerolearn.models import GPTConfig, build_model

__all__ = ["BATCH", "GPT", "LR", "dpu_loss_curves", "quantization_errors"]

GPT = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)
BATCH, LR = 8, 1e-3


def _host_adam(master: torch.Tensor, lr: float):
    """``host_step(grad)``: torch's Adam on the fp32 ``master`` (1-D), in place: the CPU's step."""
    leaf = torch.nn.Parameter(master)  # shares master's storage: the step updates master itself
    opt = torch.optim.Adam([leaf], lr=lr)

    def host_step(grad: torch.Tensor) -> None:
        leaf.grad = grad
        opt.step()

    return host_step


def dpu_loss_curves(steps: int = 40, lr: float = LR) -> dict:
    """Train the chapter's GPT for ``steps`` steps twice, plain and with DPU; fp32, one process.

    The "device" computes forward and backward on ``params`` (a flat fp32 copy of the
    parameters); the "host" keeps the fp32 master and Adam's moments and steps on a
    worker thread. Plain: every step waits for the host's update on that thread. DPU: step 0 waits, then
    each host update runs while the next step computes (:func:`dpu_step`).

    Returns:
        ``{"plain": [loss per step], "dpu": [...], "step_s": {"plain": s, "dpu": s},
        "psi": parameters}``: losses are fp32 means over the global batch of ``BATCH``
        sequences; ``step_s`` the median wall time of a step on this machine (seconds).
    """
    out: dict = {"step_s": {}}
    for mode in ("plain", "dpu"):
        model = build_model("gpt", 0, gpt=GPT)
        with torch.no_grad():
            params = parameters_to_vector(model.parameters()).detach().clone()
        master = params.clone()
        host_step, pending, losses, times = _host_adam(master, lr), None, [], []
        with ThreadPoolExecutor(max_workers=1) as worker:
            for step in range(steps):
                t0 = time.perf_counter()
                with torch.no_grad():
                    vector_to_parameters(params, model.parameters())  # the forward reads what was published
                x, y = data.gpt_batch(step, BATCH, GPT.seq_len, seed=0)
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                grad = parameters_to_vector(p.grad for p in model.parameters())  # "copied to the host"
                with torch.no_grad():
                    if mode == "plain":  # the same worker, waited for at once
                        worker.submit(host_step, grad).result()
                        params.copy_(master)
                    else:
                        pending = dpu_step(step, params, master, grad, host_step, pending, worker)
                losses.append(loss.item())
                times.append(time.perf_counter() - t0)
            if pending is not None:
                pending.result()
        out[mode], out["step_s"][mode] = losses, statistics.median(times[1:])
    out["psi"] = params.numel()
    return out


def _relative_error(x: torch.Tensor, back: torch.Tensor) -> float:
    return float((back - x).norm() / x.norm())


def quantization_errors(block: int = 256) -> list[dict]:
    """qwZ (int8) on a GPT's parameters and qgZ (int4) on its gradients, block-wise and with one
    scale for the whole tensor (:func:`zerolearn.zeropp.quantize`).

    Returns:
        One dict per (what, bits, scales): ``what`` ("parameters" or "gradients"),
        ``bits``, ``scales`` ("per block of N" or "one per tensor"), ``elements``,
        ``bytes`` (codes plus fp32 scales), ``fp16_bytes`` (2 per element),
        ``rel_error`` (||dequantized - x|| / ||x||) and ``worst_in_steps`` (the largest
        |dequantized - x| in units of its own block's scale: at most 0.5 when rounding to
        nearest).
    """
    from zerolearn import zeropp

    model = build_model("gpt", 0, gpt=GPT)
    x, y = data.gpt_batch(0, BATCH, GPT.seq_len, seed=0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    tensors = {"parameters": parameters_to_vector(model.parameters()).detach(),
               "gradients": parameters_to_vector(p.grad for p in model.parameters())}
    rows = []
    for (what, t), bits in zip(tensors.items(), (8, 4), strict=True):
        for size, label in ((block, f"per block of {block}"), (t.numel(), "one per tensor")):
            q, scales = zeropp.quantize(t, bits=bits, block=size)
            back = zeropp.dequantize(q, scales, t.numel(), bits=bits, block=size)
            step = scales.repeat_interleave(size)[:t.numel()]
            rows.append({"what": what, "bits": bits, "scales": label, "elements": t.numel(),
                         "bytes": zeropp.quantized_bytes(t.numel(), bits, size), "fp16_bytes": 2 * t.numel(),
                         "rel_error": _relative_error(t, back),
                         "worst_in_steps": float(((back - t).abs() / step.clamp_min(1e-30)).max())})
    return rows
