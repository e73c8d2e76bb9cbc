"""The paper map's second table: the headline claims of ZeRO's successors, and what the
package computes or measures for each.

* ZeRO-Offload: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training",
  USENIX ATC 2021 (arXiv 2101.06840).
* ZeRO-Infinity: Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for
  Extreme Scale Deep Learning", SC'21 (arXiv 2104.07857).
* ZeRO++: Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant
  Model Training", arXiv 2306.10209 (2023).

As in the first table, every number in "zerolearn computes" comes from the package's
own functions: :func:`zerolearn.memory.model.offload_state_bytes` and
:func:`~zerolearn.memory.model.model_state_bytes` for bytes by location,
:func:`zerolearn.costmodel.offload_traffic_bytes` and
:func:`~zerolearn.costmodel.zeropp_cross_node_bytes` for traffic,
:func:`~zerolearn.costmodel.infinity_bandwidth_GBps` for ZeRO-Infinity's bandwidth analysis.
Chapter 8 measures what runs on gloo ranks of one machine; :mod:`zerolearn.papermap.checks`
holds the statuses of the measured rows to those measurements.
"""

from __future__ import annotations

from zerolearn.costmodel import (
    infinity_ait,
    infinity_bandwidth_GBps,
    infinity_efficiency,
    offload_traffic_bytes,
    zeropp_cross_node_bytes,
)
from zerolearn.memory.model import GB, V100_BYTES, model_state_bytes, offload_state_bytes
from zerolearn.papermap.base import NOT_REPRODUCIBLE, REPRODUCED, SHAPE_ONLY, Row
from zerolearn.papermap.text import _gb, _sig

__all__ = ["CH8", "successor_rows"]

DGX2_HOST_BYTES = 1.5e12
"""Host memory of one DGX-2 node (1.5 TB, NVIDIA's datasheet; ZeRO-Infinity's testbed)."""

CH8 = "ch. 8 on 2 ranks"
CH8_NODES = "ch. 8 on 4 ranks as 2 nodes of 2"


def _tb(nbytes: float) -> str:
    """Bytes in decimal TB (1e12), 1 decimal."""
    return f"{nbytes / 1e12:.1f} TB"


def _located(psi: float, nd: int, stage: int, offload: str | None) -> dict[str, float]:
    """Total bytes per rank on the device, in host memory and on disk (bf16, K = 12)."""
    return {where: sum(b.values()) for where, b in offload_state_bytes(psi, nd, stage, offload).items()}


def _offload() -> list[Row]:
    per_param = _located(1, 1, 2, "cpu")  # bytes per parameter on one GPU, ZeRO-2 + CPU offload
    dp_max, offload_max = V100_BYTES / _located(1, 1, 0, None)["device"], V100_BYTES / per_param["device"]
    return [
        Row("offload-placement", "ZeRO-Offload", "on top of ZeRO-2, the fp32 optimizer states and the gradients "
            "live in host memory and the optimizer step runs on the CPU; the 2-byte parameters stay on the GPU",
            f"`offload_state_bytes(psi, 1, 2, 'cpu')` per parameter: {per_param['device']:g} bytes on the device, "
            f"{per_param['host']:g} in host memory (fp32 gradient 4 + Adam's K = 12)",
            f"{CH8} (bytes per location measured from the engines' tensors)", REPRODUCED,
            values={"device": per_param["device"], "host": per_param["host"]}),
        Row("offload-13b", "ZeRO-Offload", "about 13B parameters train on one 32 GB V100, about 10x what PyTorch "
            "alone fits", f"model states on one 32 GB GPU: {dp_max / 1e9:.1f}B without offload (16 bytes a "
            f"parameter), {offload_max / 1e9:.1f}B with ZeRO-2 + CPU offload (2 bytes), {_sig(offload_max / dp_max)}x",
            "ch. 8 (widget)", SHAPE_ONLY, "model states only; the 13B and the 10x are measured on a V100 with "
            "activations and buffers on top", {"dp_b": dp_max / 1e9, "offload_b": offload_max / 1e9}),
        Row("offload-dpu", "ZeRO-Offload", "the one-step delayed parameter update (DPU) overlaps the CPU's step "
            "with the GPU's next forward and backward, which use parameters one update old; applied after the "
            "first steps, it leaves convergence close to the synchronous run's",
            "`offload_step_time`: a step takes device + PCIe + host seconds without DPU, max(device, host) + PCIe "
            "with it", "ch. 8 on 1 process (DPU's loss curve beside the synchronous one, measured)", SHAPE_ONLY,
            "the staleness is measured on a small GPT; the overlap pays off when a GPU and a CPU compute at once, "
            "while here both are the same CPU cores"),
    ]


def _infinity() -> list[Row]:
    big = model_state_bytes(32e12, 512, 3)["total"]
    node = model_state_bytes(1e12, 16, 3)["total"]
    ours = _located(1e12, 16, 3, "disk")
    disk_per_gpu = offload_traffic_bytes(1e12, 512, 3, "disk")["disk"]
    pg, opt = infinity_ait("parameters and gradients"), infinity_ait("optimizer states", batch_per_gpu=2)
    needs = {"pg": infinity_bandwidth_GBps(0.5, pg), "os": infinity_bandwidth_GBps(0.9, opt),
             "os_at_1500": infinity_efficiency(opt, 1500),
             "ac_2k": infinity_bandwidth_GBps(0.5, infinity_ait("activation checkpoints", hidden=2048)),
             "ac_8k": infinity_bandwidth_GBps(0.5, infinity_ait("activation checkpoints", hidden=8192))}
    return [
        Row("infinity-32t", "ZeRO-Infinity", "32 trillion parameters trained on 512 V100 GPUs (32 DGX-2 nodes), "
            "with ZeRO-3's states on GPU, CPU and NVMe memory",
            f"`model_state_bytes(32e12, 512, 3)`: {_tb(big)} of model states per GPU, {_sig(big / V100_BYTES)}x a "
            "32 GB V100: they must live in host memory and on NVMe", "-", NOT_REPRODUCIBLE,
            "needs 32 DGX-2 nodes and their NVMe drives", {"tb_per_gpu": big / 1e12}),
        Row("infinity-1t", "ZeRO-Infinity", "a trillion parameters fine-tuned on one DGX-2 node (16 GPUs)",
            f"`model_state_bytes(1e12, 16, 3)`: {_tb(node)} per GPU; `offload_state_bytes(1e12, 16, 3, 'disk')`: "
            f"{_gb(ours['device'])} of model states on each GPU between uses, {_gb(ours['host'])} in host memory "
            f"(the fp32 gradient shard), {_gb(ours['disk'])} on disk; 16 GPUs' gradient shards make "
            f"{_tb(16 * ours['host'])} of host memory, where a DGX-2 has {_tb(DGX2_HOST_BYTES)}",
            "ch. 8 on 2 ranks (stage 3 with disk offload, bytes per location measured)", NOT_REPRODUCIBLE,
            "needs a DGX-2 node and its NVMe drives; DeepSpeed's NVMe path swaps the fp32 gradients to NVMe too, "
            "while the package's disk offload keeps them in host memory, which one node's 1.5 TB could not hold",
            {"device_gb": ours["device"] / GB, "host_gb": ours["host"] / GB, "disk_gb": ours["disk"] / GB}),
        Row("infinity-bandwidth", "ZeRO-Infinity", "bandwidth-centric partitioning: each rank reads and writes its "
            "own partition of the offloaded states, so the aggregate host and NVMe bandwidth grows with the GPUs",
            f"`offload_traffic_bytes(1e12, 512, 3, 'disk')`: {_gb(disk_per_gpu)} read and written per GPU a step "
            "((2 K + 3 w) Psi / Nd: the optimizer states read and written, and stage 3's parameter shard read "
            "for forward and for backward and written after the step, w = 2 bytes; falling as 1/Nd)",
            f"{CH8} (bytes each rank reads and writes measured)", SHAPE_ONLY,
            "the ranks of one machine share one disk here, so their bandwidth does not add up"),
        Row("infinity-bandwidth-needs", "ZeRO-Infinity", "its bandwidth analysis (Sec 4, Fig 3, on V100 GPUs): "
            "about 70 GB/s for parameters and gradients keeps over half the peak even at batch 1 per GPU; "
            "optimizer states need about 1.5 TB/s for 90% at batch 2; activation checkpoints a few GB/s",
            f"`infinity_bandwidth_GBps` on `infinity_ait`, at a peak of 70 TFLOP/s per V100 (the book's assumption): "
            f"{needs['pg']:.1f} GB/s for parameters and gradients at "
            f"50% (batch 1, seq 1K); {needs['os'] / 1e3:.2f} TB/s for optimizer states at 90% (batch 2), where "
            f"1.5 TB/s gives {_sig(100 * needs['os_at_1500'])}%; {needs['ac_2k']:.2f} GB/s for checkpoints at 50% "
            f"(width 2K, one per layer), {needs['ac_8k']:.2f} GB/s at width 8K",
            "ch. 8 (computed)", SHAPE_ONLY, "computed from the paper's formulas; the bandwidths of its V100 "
            "cluster are not measured here", needs),
        Row("infinity-overlap", "ZeRO-Infinity", "overlap-centric design (prefetching the next layers' "
            "parameters from CPU and NVMe while computing) and memory-centric tiling (splitting an operator too large "
            "for the GPU)", "not built: the "
            "engines read a unit's parameter shard just before its gather, and a bucket's optimizer states just "
            "before its step, without prefetching, and do not tile operators", "-",
            NOT_REPRODUCIBLE, "not implemented in the package"),
    ]


def _zeropp() -> list[Row]:
    psi, nd, k = 1e9, 16, 8  # per parameter: any psi gives the same ratios; 2 nodes of 8
    plain = zeropp_cross_node_bytes(psi, nd, k)
    qwz = zeropp_cross_node_bytes(psi, nd, k, qwz=True)
    hpz = zeropp_cross_node_bytes(psi, nd, k, hpz=True)
    qgz = zeropp_cross_node_bytes(psi, nd, k, qgz=True)
    both = zeropp_cross_node_bytes(psi, nd, k, qwz=True, hpz=True, qgz=True)
    rounded = zeropp_cross_node_bytes(psi, nd, k, qwz=True, hpz=True, qgz=True, scale_bytes=0)
    return [
        Row("zeropp-qwz", "ZeRO++", "qwZ: ZeRO-3's weight all-gather in int8 with one scale per block, half the "
            "bytes of fp16; blocks keep the error well below one scale per tensor",
            f"`zeropp_cross_node_bytes(qwz=True)`, blocks of 256 with fp32 scales: "
            f"{_sig(qwz['forward_gather'] / plain['forward_gather'])} of fp16's bytes", f"{CH8_NODES} (bytes "
            "measured by the ledger; error measured on a GPT's parameters); exercise `08.quantized_all_gather`",
            REPRODUCED, values={"ratio": qwz["forward_gather"] / plain["forward_gather"]}),
        Row("zeropp-hpz", "ZeRO++", "hpZ: a secondary partition of the parameters inside each node, so "
            "backward's all-gather never crosses nodes, for Psi / (GPUs per node) more elements per GPU",
            f"backward's cross-node bytes {hpz['backward_gather']:g}; {_sig(hpz['hpz_extra_bytes'] / (2 * psi))} "
            f"of the fp16 model more per GPU in nodes of {k}", f"{CH8_NODES} (bytes across the boundary measured)",
            REPRODUCED, values={"extra": hpz["hpz_extra_bytes"] / (2 * psi)}),
        Row("zeropp-qgz", "ZeRO++", "qgZ: the gradient reduce-scatter replaced by an int4 all-to-all in two hops, "
            "inside the node then across nodes: a quarter of fp16's gradient bytes cross nodes",
            f"{_sig(qgz['gradients'] / plain['gradients'])} of fp16's gradient bytes (int4 plus fp32 scales), the "
            "paper's quarter", f"{CH8_NODES} (bytes measured on the ledger's link model: about half the quarter "
            "on nodes of 2, since the first hop sums the node's 2 partial gradients before anything crosses; "
            "error measured on a GPT's gradients)", SHAPE_ONLY,
            "the ledger models each link (a rank sends each peer its piece), "
            "so it counts the first hop's sum over the node's N GPUs, M / (Z N) per GPU with Z = 4, that the "
            "headline quarter leaves out; `qgz_cross_node_bytes(hops=2)` computes that count and equals the "
            "measurement within 2% (ch. 8)", values={"ratio": qgz["gradients"] / plain["gradients"]}),
        Row("zeropp-4x", "ZeRO++", "together, ZeRO-3's cross-node traffic falls from 3M to 0.75M (M: the model in "
            "fp16), 4x less, for up to 2.16x the throughput on 384 GPUs",
            f"{_sig(plain['total'] / rounded['total'])}x counting codes only, {_sig(plain['total'] / both['total'])}x "
            "with one fp32 scale per 256 elements", f"{CH8_NODES} (all three options together, measured)", SHAPE_ONLY,
            "the traffic is counted and measured; the throughput needs a cluster whose links between nodes are slow",
            {"codes_only": plain["total"] / rounded["total"], "with_scales": plain["total"] / both["total"]}),
    ]


def successor_rows() -> list[Row]:
    """The successors' rows: ZeRO-Offload, ZeRO-Infinity, ZeRO++, in that order."""
    return _offload() + _infinity() + _zeropp()


def glossary_note() -> str:
    """The box on a number about ZeRO-Infinity that the book's glossary source states differently."""
    one_node = model_state_bytes(32e12, 16, 3)["total"]
    return "\n".join([
        "```{admonition} 32 trillion parameters: 32 nodes, not one",
        ":class: note",
        "A glossary entry this book started from says ZeRO-Infinity trained 32 trillion parameters on a single "
        "DGX-2 node. The paper, and its authors' talk at SC'21, report 32 trillion on 32 DGX-2 nodes (512 V100 "
        "GPUs), and a trillion parameters fine-tuned on one node. One node's 16 GPUs would each carry "
        f"{_tb(one_node)} of model states for 32 trillion parameters (`model_state_bytes(32e12, 16, 3)`).",
        "```",
    ])
