"""Step time on paper: compute from flops, communication from volume and bandwidth.

A first-order model, for reasoning about the paper's scaling claims rather than
predicting a cluster to the percent. Every input is explicit in :class:`Hardware`
and :class:`Job`; communication volume comes from
``zerolearn.memory.model.comm_volume_elements`` (Sec 7) and memory from
``zerolearn.memory.fit.per_device_bytes`` (Sec 3, 5).

    compute_s = flops_per_param_token x (psi / nm) x tokens_per_gpu / achieved FLOP/s
    comm_s    = volume_bytes / bandwidth + latency x collectives
    step_s    = compute_s + comm_s - min(overlap x comm_s, compute_s)

flops_per_param_token is 6: a forward pass does one multiply-add (2 flops) per
parameter per token, the backward pass twice that (gradients for activations and
for weights: 4 flops). Activation recomputation (Sec 3.2, 6.1) runs the forward
again: 8. This counting is standard (Kaplan et al. 2020), not from the ZeRO paper.

Overlap: a fraction ``overlap`` of the communication runs behind compute (bucketed
reductions launched from backward hooks, Sec 5.2), but it cannot hide more than the
compute lasts. So overlap = 0 gives compute + comm and overlap = 1 gives
max(compute, comm).

The memory side is :func:`max_batch_per_gpu` and :func:`throughput_per_gpu`: the
paper's super-linear scaling argument (Sec 10.3, Fig 3).

Beyond the paper (chapter 8): :func:`offload_step_time` adds ZeRO-Offload's and
ZeRO-Infinity's host side to a step (copies over PCIe, the optimizer step on the CPU,
optimizer states read and written on NVMe, and the delayed parameter update that hides
the CPU's step behind the device's next one), with the inputs in :class:`HostSide`;
:func:`zeropp_cross_node_bytes` counts what ZeRO-3 and ZeRO++ send across node
boundaries per step, and :func:`qgz_cross_node_bytes` qgZ's gradients in one hop or two.
:func:`infinity_ait`, :func:`infinity_efficiency` and :func:`infinity_bandwidth_GBps` are
ZeRO-Infinity's bandwidth analysis (its Sec 4): the bandwidth each kind of data needs for
a given fraction of peak.

Units: seconds, bytes, decimal GB/s (1e9 bytes/s), TFLOP/s (1e12 flop/s).
Bad inputs raise :class:`zerolearn.dist.ConfigError` when the dataclass is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from zerolearn.errors import ConfigError, require_choice, require_count, require_real
from zerolearn.memory.fit import ActivationSpec, per_device_bytes
from zerolearn.memory.model import comm_volume_elements, dtype_bytes

__all__ = ["FLOPS_PER_PARAM_TOKEN", "FLOPS_PER_PARAM_TOKEN_RECOMPUTE", "INFINITY_PEAK_FLOPS", "INFINITY_STATES",
           "OFFLOADS", "EfficiencyCurve", "Hardware", "HostSide", "Job", "OffloadStepTime", "StepTime", "Throughput",
           "infinity_ait", "infinity_bandwidth_GBps", "infinity_efficiency", "max_batch_per_gpu", "offload_step_time",
           "offload_traffic_bytes", "qgz_cross_node_bytes", "step_time", "throughput_per_gpu",
           "zeropp_cross_node_bytes"]

FLOPS_PER_PARAM_TOKEN = 6
"""Training flops per parameter per token: forward 2 + backward 4 (see module docstring)."""
FLOPS_PER_PARAM_TOKEN_RECOMPUTE = 8
"""The same with activation recomputation: one more forward pass (+2)."""


def _positive(name: str, value: float, allow_inf: bool = False) -> None:
    require_real(name, value, allow_inf=allow_inf)


def _count(name: str, value: int) -> None:
    require_count(name, value)


@dataclass(frozen=True)
class Hardware:
    """What one GPU and its links deliver.

    tflops_achieved: sustained TFLOP/s per GPU on this job (not the datasheet peak;
        the paper's V100s reached 38-41, Sec 10.2, 10.6).
    intra_node_GBps, inter_node_GBps: per-GPU bus bandwidth of a ring collective
        inside one node and across nodes, decimal GB/s (the paper's DGX-2 cluster:
        NVSwitch 300 GB/s, Sec 10.2; 800 Gbps per node of 16 GPUs, Sec 10.1, so
        6.25 GB/s per GPU between nodes). inf is allowed.
    gpus_per_node: GPUs sharing the fast intra-node links (16 on a DGX-2).
    latency_s_per_collective: fixed cost of one collective launch, seconds (>= 0).
    """

    tflops_achieved: float
    intra_node_GBps: float
    inter_node_GBps: float
    gpus_per_node: int = 8
    latency_s_per_collective: float = 0.0

    def __post_init__(self) -> None:
        _positive("tflops_achieved", self.tflops_achieved)
        _positive("intra_node_GBps", self.intra_node_GBps, allow_inf=True)
        _positive("inter_node_GBps", self.inter_node_GBps, allow_inf=True)
        _count("gpus_per_node", self.gpus_per_node)
        require_real("latency_s_per_collective", self.latency_s_per_collective, strict=False)


@dataclass(frozen=True)
class Job:
    """One training step of a data-parallel job, per GPU.

    psi: parameters of the whole model. tokens_per_gpu: tokens each GPU processes
    per step (batch_per_gpu x seq_len). stage 0-3, nd data-parallel degree, nm
    model-parallel degree (each GPU holds and computes psi / nm parameters; MP's own
    communication, Sec 8, is not modelled). overlap: fraction of communication hidden
    behind compute, 0-1. grad_dtype: element width of the collectives (params and
    grads travel in the working dtype). recompute: activation checkpointing, 8
    instead of 6 flops per parameter per token. bucket_elements: elements per
    collective call (DeepSpeed's default bucket is 5e8 elements).
    """

    psi: float
    tokens_per_gpu: int
    stage: int
    nd: int
    nm: int = 1
    overlap: float = 0.0
    grad_dtype: str = "bf16"
    recompute: bool = False
    bucket_elements: int = 500_000_000

    def __post_init__(self) -> None:
        _positive("psi", self.psi)
        for name in ("tokens_per_gpu", "nd", "nm", "bucket_elements"):
            _count(name, getattr(self, name))
        require_choice("stage", self.stage, (0, 1, 2, 3))
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, (int, float)) \
                or not 0 <= self.overlap <= 1:
            raise ConfigError(f"overlap {self.overlap!r}: must be a number in [0, 1]")
        try:
            dtype_bytes(self.grad_dtype)
        except ValueError as e:
            raise ConfigError(f"grad_dtype: {e}") from None


@dataclass(frozen=True)
class StepTime:
    """Seconds per step and its parts; ``volume_bytes`` moved per GPU by ``collectives`` calls."""

    compute_s: float
    comm_s: float
    step_s: float
    volume_bytes: float
    collectives: int

    @property
    def comm_to_compute(self) -> float:
        return self.comm_s / self.compute_s


def _bandwidth_bytes_per_s(job: Job, hw: Hardware) -> float:
    """Bytes/s of the ring's slowest link.

    A ring runs at its slowest hop. While all nd x nm GPUs of the job sit in one
    node every hop is intra-node; beyond that, MP groups are kept inside nodes (MP
    is fast only there, Sec 1) and the data-parallel rings cross nodes."""
    within_node = job.nd * job.nm <= hw.gpus_per_node
    return (hw.intra_node_GBps if within_node else hw.inter_node_GBps) * 1e9


def step_time(job: Job, hw: Hardware) -> StepTime:
    """Compute, communication and step seconds of ``job`` on ``hw`` (module docstring).

    Communication per GPU: the paper's volume (2 psi for stages 0-2, 3 psi for
    stage 3, Sec 7) times the ring's (Nd - 1) / Nd (which the paper drops; it makes
    Nd = 1 free), in bytes of ``grad_dtype``. Collectives: each psi of volume is one
    pass of bucketed calls (an all-reduce is a reduce-scatter plus an all-gather,
    two passes, Sec 7.1), ceil(psi / bucket_elements) calls a pass, each paying the
    latency once. Stage 3 really gathers per module; buckets are a lower bound there.
    """
    psi_local = job.psi / job.nm
    flops_per = FLOPS_PER_PARAM_TOKEN_RECOMPUTE if job.recompute else FLOPS_PER_PARAM_TOKEN
    compute_s = flops_per * psi_local * job.tokens_per_gpu / (hw.tflops_achieved * 1e12)

    if job.nd == 1:  # nobody to talk to: no collectives at all
        volume_bytes, collectives = 0.0, 0
    else:
        ring = (job.nd - 1) / job.nd
        volume_bytes = comm_volume_elements(psi_local, job.stage) * dtype_bytes(job.grad_dtype) * ring
        passes = comm_volume_elements(1, job.stage)  # 2 or 3 psi-sized passes per step
        collectives = passes * math.ceil(psi_local / job.bucket_elements)
    comm_s = volume_bytes / _bandwidth_bytes_per_s(job, hw) + hw.latency_s_per_collective * collectives

    hidden = min(job.overlap * comm_s, compute_s)  # overlap cannot hide more than compute
    return StepTime(compute_s=compute_s, comm_s=comm_s, step_s=compute_s + comm_s - hidden,
                    volume_bytes=volume_bytes, collectives=collectives)


@dataclass(frozen=True)
class EfficiencyCurve:
    """Achieved TFLOP/s per GPU as a function of batch per GPU: peak x b / (b + b_half).

    An ASSUMPTION for teaching, not the paper's: a saturating curve with half the
    peak at ``b_half`` sequences. It encodes what Sec 10.3 states in words: larger
    batches per GPU mean more arithmetic per kernel and higher efficiency.
    """

    peak_tflops: float
    b_half: float

    def __post_init__(self) -> None:
        _positive("peak_tflops", self.peak_tflops)
        _positive("b_half", self.b_half)

    def __call__(self, batch_per_gpu: int) -> float:
        return self.peak_tflops * batch_per_gpu / (batch_per_gpu + self.b_half)


ZERO_R_CB_BYTES = 500_000_000 * 4
"""ZeRO-R's constant-size buffer (CB, Sec 6.2) for stages 1-3, bytes. The paper gives
no size; this is DeepSpeed's default bucket, 5e8 fp32 elements. DP keeps Sec 3.2's one
fused fp32 buffer for every gradient."""


def max_batch_per_gpu(psi: float, device_bytes: float, stage: int, nd: int, *, hidden: int, layers: int,
                      seq_len: int, checkpointing: bool = True, optimizer: str = "adam",
                      dtype: str = "bf16", nm: int = 1) -> int:
    """Largest batch per GPU (sequences) whose model and residual states fit (Sec 10.3).

    ZeRO stages 1-3 shrink model states as Nd grows (Sec 5), leaving more of
    ``device_bytes`` for activations (``fit.per_device_bytes``, which also counts one
    block's recomputation and the temporary buffers: DP's fused fp32 buffer of 4 Psi
    / Nm bytes, stages 1-3 ZeRO-R's ``ZERO_R_CB_BYTES``); DP's model states do not
    shrink, so its largest batch is the same at every Nd. Returns 0 when not even one
    sequence fits. Raises ConfigError for bad input.
    """
    cb = None if stage == 0 else ZERO_R_CB_BYTES

    def fits(batch: int) -> bool:
        act = ActivationSpec(hidden, layers, batch, seq_len, checkpointing, constant_buffer_bytes=cb)
        need = per_device_bytes(psi, nd, stage, optimizer=optimizer, dtype=dtype, nm=nm, activation=act)
        return need["total"] <= device_bytes

    _positive("device_bytes", device_bytes)
    if not fits(1):  # also validates every argument before the search
        return 0
    lo, hi = 1, 2  # grow hi until it does not fit; activations grow with batch, so this ends
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Throughput:
    """Per-GPU result of :func:`throughput_per_gpu`; all zero when nothing fits."""

    batch_per_gpu: int
    tflops_per_gpu: float
    tokens_per_s_per_gpu: float
    step: StepTime | None


def throughput_per_gpu(psi: float, device_bytes: float, stage: int, nd: int, hw: Hardware,
                       curve: EfficiencyCurve, *, hidden: int, layers: int, seq_len: int,
                       checkpointing: bool = True, overlap: float = 0.0, optimizer: str = "adam",
                       dtype: str = "bf16", nm: int = 1) -> Throughput:
    """Throughput per GPU at the largest batch that fits: the super-linear argument (Sec 10.3).

    The batch comes from :func:`max_batch_per_gpu`, the achieved TFLOP/s from
    ``curve`` at that batch (overriding ``hw.tflops_achieved``), the step from
    :func:`step_time`. ``tflops_per_gpu`` counts the flops actually run (recompute
    included) over the whole step, communication included. As Nd grows, ZeRO frees
    memory, the batch grows, and both efficiency and the compute that hides a fixed
    communication volume grow: per-GPU throughput rises with Nd (Fig 3: 60B model,
    64 to 400 GPUs). Raises ConfigError for bad input.
    """
    batch = max_batch_per_gpu(psi, device_bytes, stage, nd, hidden=hidden, layers=layers, seq_len=seq_len,
                              checkpointing=checkpointing, optimizer=optimizer, dtype=dtype, nm=nm)
    if batch == 0:
        return Throughput(batch_per_gpu=0, tflops_per_gpu=0.0, tokens_per_s_per_gpu=0.0, step=None)
    job = Job(psi=psi, tokens_per_gpu=batch * seq_len, stage=stage, nd=nd, nm=nm, overlap=overlap,
              grad_dtype=dtype, recompute=checkpointing)
    step = step_time(job, dataclasses.replace(hw, tflops_achieved=curve(batch)))
    flops_per = FLOPS_PER_PARAM_TOKEN_RECOMPUTE if checkpointing else FLOPS_PER_PARAM_TOKEN
    flops = flops_per * (psi / nm) * job.tokens_per_gpu
    return Throughput(batch_per_gpu=batch, tflops_per_gpu=flops / step.step_s / 1e12,
                      tokens_per_s_per_gpu=job.tokens_per_gpu / step.step_s, step=step)


# ----- beyond the paper: offload (ZeRO-Offload, ZeRO-Infinity) and ZeRO++ ---------------------

OFFLOADS = (None, "cpu", "disk")
"""Where the offloaded states live: nowhere (all on the device), host memory, or disk (NVMe)."""


@dataclass(frozen=True)
class HostSide:
    """What the host delivers to one GPU's offloaded states.

    pcie_GBps: host <-> device copy bandwidth per GPU, each direction, decimal GB/s.
    host_adam_elements_per_s: elements per second the CPU's Adam updates for this GPU
        (its share of the host's cores).
    disk_GBps: NVMe bandwidth for this GPU's states, reads and writes together, decimal GB/s.

    These are inputs, not the papers' measurements; chapter 8's widget puts them on sliders.
    Raises ConfigError for a value that is not a positive number (inf allowed).
    """

    pcie_GBps: float
    host_adam_elements_per_s: float
    disk_GBps: float

    def __post_init__(self) -> None:
        for name in ("pcie_GBps", "host_adam_elements_per_s", "disk_GBps"):
            _positive(name, getattr(self, name), allow_inf=True)


def offload_traffic_bytes(psi: float, nd: int, stage: int, offload: str | None, dtype: str = "bf16",
                          k: float = 12) -> dict[str, float]:
    """Bytes one GPU moves to and from its host per step, and the elements its CPU updates.

    ZeRO-Offload (Ren et al., ATC'21, arXiv 2101.06840) keeps the fp32 optimizer states
    and gradients on the host and the working-dtype parameters on the device: each step
    the rank's partition of the gradient (``psi / nd`` elements in ``dtype``) goes down and
    the updated partition of the parameters comes back, and the CPU's Adam updates ``psi /
    nd`` elements. With ``offload="disk"`` (ZeRO-Infinity, Rajbhandari et al., SC'21, arXiv
    2104.07857) the K bytes per parameter of optimizer states live on NVMe and are read
    and written once a step; at stage 3 the rank's parameter shard lives there too, read
    for the forward's gathers and again for backward's and written after the step (3 w
    bytes per element of the shard, w the bytes of ``dtype``), and it crosses PCIe on
    both reads (2 w more). This is where the package's engines keep them
    (:mod:`zerolearn.engines.offload`). ``offload=None`` moves nothing.

    Returns:
        ``{"pcie": bytes, "disk": bytes, "host_elements": elements}`` per GPU per step.

    Raises:
        ConfigError: a stage outside 1-3 with offload (the papers offload ZeRO's partitions:
            stage 0 has none), an unknown ``offload`` or ``dtype``, bad counts.
    """
    require_choice("offload", offload, OFFLOADS)
    require_choice("stage", stage, (0, 1, 2, 3))
    _count("nd", nd)
    _positive("psi", psi)
    _positive("k", k)
    try:
        width = dtype_bytes(dtype)
    except ValueError as e:
        raise ConfigError(f"dtype: {e}") from None
    if offload is None:
        return {"pcie": 0.0, "disk": 0.0, "host_elements": 0.0}
    if stage == 0:
        raise ConfigError("offload with stage 0: offload moves a rank's ZeRO partition to the host; choose stage 1-3")
    part = psi / nd
    params_on_disk = offload == "disk" and stage == 3
    disk = 2 * k * part + (3 * width * part if params_on_disk else 0.0) if offload == "disk" else 0.0
    pcie = 2 * width * part + (2 * width * part if params_on_disk else 0.0)
    return {"pcie": pcie, "disk": disk, "host_elements": part}


@dataclass(frozen=True)
class OffloadStepTime:
    """Seconds per step with offload: the device's own step (compute and collectives,
    :func:`step_time`), the PCIe copies, the CPU's optimizer step, the disk I/O, and the total."""

    device_s: float
    pcie_s: float
    cpu_s: float
    disk_s: float
    step_s: float
    dpu: bool

    @property
    def host_s(self) -> float:
        """The host's part of a step: states read from disk, stepped on the CPU, written back."""
        return self.cpu_s + self.disk_s


def offload_step_time(job: Job, hw: Hardware, host: HostSide, offload: str | None, dpu: bool = False,
                      k: float = 12) -> OffloadStepTime:
    """Step seconds of ``job`` with its optimizer step offloaded to ``host`` (chapter 8).

    device_s = ``step_time(job, hw).step_s``; pcie_s = ``offload_traffic_bytes["pcie"]`` /
    pcie bandwidth; cpu_s = host elements / Adam's elements per second; disk_s = disk
    bytes / disk bandwidth. Then

        without DPU: step_s = device_s + pcie_s + cpu_s + disk_s
        with DPU:    step_s = max(device_s, cpu_s + disk_s) + pcie_s

    ZeRO-Offload's one-step delayed parameter update runs the CPU's step (with its disk
    I/O) while the device runs the next forward and backward, so the longer of the two
    sets the pace. The copies stay on the critical path here (ZeRO-Offload overlaps the
    gradients' copy with backward, so this is an upper bound), and so does the disk I/O
    without DPU (ZeRO-Infinity's overlap-centric design prefetches *parameters* under
    compute; its optimizer states are read and written in the step, which DeepSpeed
    pipelines with the CPU's Adam: also an upper bound). ``offload=None`` gives ``step_time``'s step and zeros. The grad
    dtype of ``job`` is the dtype of the copies.

    Raises:
        ConfigError: as :func:`offload_traffic_bytes`; ``dpu`` without offload (there is
            no host step to delay).
    """
    if dpu and offload is None:
        raise ConfigError("dpu=True needs offload='cpu' or 'disk': DPU delays the host's optimizer step")
    traffic = offload_traffic_bytes(job.psi / job.nm, job.nd, job.stage, offload, job.grad_dtype, k)
    device_s = step_time(job, hw).step_s
    pcie_s = traffic["pcie"] / (host.pcie_GBps * 1e9)
    cpu_s = traffic["host_elements"] / host.host_adam_elements_per_s
    disk_s = traffic["disk"] / (host.disk_GBps * 1e9)
    step_s = max(device_s, cpu_s + disk_s) + pcie_s if dpu else device_s + pcie_s + cpu_s + disk_s
    return OffloadStepTime(device_s=device_s, pcie_s=pcie_s, cpu_s=cpu_s, disk_s=disk_s, step_s=step_s, dpu=dpu)


def zeropp_cross_node_bytes(psi: float, nd: int, gpus_per_node: int, *, qwz: bool = False, hpz: bool = False,
                            qgz: bool = False, dtype: str = "fp16", block: int = 256,
                            scale_bytes: int = 4) -> dict[str, float]:
    """Bytes ZeRO-3 sends across node boundaries per GPU per step, with ZeRO++'s options.

    ZeRO++ (Wang et al. 2023, arXiv 2306.10209) counts ZeRO-3's traffic in units of the
    model's size in the working dtype, M = ``dtype`` bytes x psi: an all-gather of the
    parameters before forward (M), another before backward (M) and a reduce-scatter of
    the gradients (M), 3M in all (the ring's (Nd - 1) / Nd factor left out, as there).
    qwZ sends the forward's weights as int8 with one scale per ``block`` elements
    (psi + ``scale_bytes`` psi / block bytes, about M / 2); hpZ keeps a secondary copy of
    the parameters partitioned inside each node, so backward's all-gather never leaves
    the node (0 across); qgZ sends the gradients as int4 in a hierarchical all-to-all
    (psi / 2 + ``scale_bytes`` psi / block bytes, about M / 4). All three: about 0.75M,
    a 4x reduction. When all ``nd`` GPUs sit in one node nothing crosses a boundary.

    Returns:
        ``{"forward_gather", "backward_gather", "gradients", "total", "hpz_extra_bytes"}``:
        bytes per GPU per step across node boundaries, and the memory hpZ's secondary
        partition adds per GPU (``dtype`` bytes x psi / gpus_per_node; 0 without hpZ).

    Raises:
        ConfigError: bad counts, an unknown ``dtype``, a negative ``scale_bytes``.
    """
    _positive("psi", psi)
    for name, value in (("nd", nd), ("gpus_per_node", gpus_per_node), ("block", block)):
        _count(name, value)
    require_real("scale_bytes", scale_bytes, strict=False)
    try:
        width = dtype_bytes(dtype)
    except ValueError as e:
        raise ConfigError(f"dtype: {e}") from None
    m = width * psi
    hpz_extra = width * psi / gpus_per_node if hpz else 0.0
    if nd <= gpus_per_node:  # one node: every hop is inside it
        return {"forward_gather": 0.0, "backward_gather": 0.0, "gradients": 0.0, "total": 0.0,
                "hpz_extra_bytes": hpz_extra}
    scales = scale_bytes * psi / block
    forward = psi + scales if qwz else m
    backward = 0.0 if hpz else forward
    gradients = psi / 2 + scales if qgz else m
    return {"forward_gather": forward, "backward_gather": backward, "gradients": gradients,
            "total": forward + backward + gradients, "hpz_extra_bytes": hpz_extra}


INFINITY_PEAK_FLOPS = 70e12
"""The peak of one V100 taken for ZeRO-Infinity's bandwidth analysis (Rajbhandari et al.,
SC'21, arXiv 2104.07857, Sec 4.2, Fig 3): 70 TFLOP/s, the book's assumption. With it the
formula gives the paper's own reading of Fig 3, about 70 GB/s for half the peak at batch 1
and sequence 1K."""

INFINITY_STATES = ("parameters and gradients", "optimizer states", "activation checkpoints")
"""The three kinds of data whose bandwidth ZeRO-Infinity's Sec 4 analyses, in its order."""


def infinity_ait(state: str, *, batch_per_gpu: int = 1, seq: int = 1024, hidden: int = 1,
                 ci: int = 1) -> float:
    """Arithmetic intensity of a training step with respect to one kind of data: flops of
    compute per byte of that data moved (ZeRO-Infinity, arXiv 2104.07857, Sec 4.1).

    A transformer of ``nl`` layers of width ``hd`` (12 nl hd^2 parameters) computes
    2 x 4 x 12 x bsz x seq x nl x hd^2 flops a step with activation checkpointing
    (forward, backward twice over, and the recompute). Against that:

    * ``"parameters and gradients"``: fp16 parameters loaded for forward, recompute and
      backward and gradients stored once, 4 x 2 bytes per parameter: ait = seq x bsz;
    * ``"optimizer states"``: 16 bytes per parameter (fp32 master, momentum, variance and
      gradient) read and written once, 32 bytes per parameter: ait = seq x bsz / 4;
    * ``"activation checkpoints"``: one fp16 checkpoint of bsz x seq x hd values every
      ``ci`` layers, written in forward and read in backward: ait = 24 x hd x ci.

    ``nl`` cancels from all three; ``hidden`` (hd) and ``ci`` matter for checkpoints only,
    ``batch_per_gpu`` (bsz) and ``seq`` for the other two.

    Returns: flops per byte (a float). Raises: ConfigError for an unknown ``state`` or a
    count that is not an integer >= 1.
    """
    require_choice("state", state, INFINITY_STATES)
    for name, value in (("batch_per_gpu", batch_per_gpu), ("seq", seq), ("hidden", hidden), ("ci", ci)):
        _count(name, value)
    if state == "parameters and gradients":
        return float(seq * batch_per_gpu)
    if state == "optimizer states":
        return seq * batch_per_gpu / 4
    return float(24 * hidden * ci)


def infinity_efficiency(ait: float, bandwidth_GBps: float, peak_flops: float = INFINITY_PEAK_FLOPS) -> float:
    """The fraction of peak a step keeps when the data of arithmetic intensity ``ait``
    (flops per byte, :func:`infinity_ait`) moves at ``bandwidth_GBps`` (decimal GB/s)
    without overlap: compute / (compute + transfer) = ait x bw / (ait x bw + peak)
    (ZeRO-Infinity, arXiv 2104.07857, Sec 4.1). Raises ConfigError for a value <= 0."""
    _positive("ait", ait)
    _positive("bandwidth_GBps", bandwidth_GBps)
    _positive("peak_flops", peak_flops)
    moved = ait * bandwidth_GBps * 1e9
    return moved / (moved + peak_flops)


def infinity_bandwidth_GBps(efficiency: float, ait: float, peak_flops: float = INFINITY_PEAK_FLOPS) -> float:
    """The bandwidth, decimal GB/s, at which :func:`infinity_efficiency` reaches
    ``efficiency`` (strictly between 0 and 1): eff x peak / (ait x (1 - eff)).
    Raises ConfigError for an efficiency outside (0, 1) or a non-positive ``ait``."""
    require_real("efficiency", efficiency)
    if not 0 < efficiency < 1:
        raise ConfigError(f"efficiency={efficiency!r}: must lie strictly between 0 and 1")
    _positive("ait", ait)
    _positive("peak_flops", peak_flops)
    return efficiency * peak_flops / (ait * (1 - efficiency)) / 1e9


def qgz_cross_node_bytes(psi: float, nd: int, gpus_per_node: int, *, hops: int = 2, block: int = 256,
                         scale_bytes: int = 4) -> dict[str, float]:
    """Bytes of int4 gradients that cross node boundaries per step, in one all-to-all or
    in qgZ's two hops (ZeRO++, arXiv 2306.10209, Sec 3.3).

    Every GPU holds a full gradient of ``psi`` elements and must end with the sum over all
    ``nd`` GPUs of its own 1/nd piece. Quantized to int4 (psi / 2 bytes plus
    ``scale_bytes`` per ``block`` elements):

    * ``hops=1``: each GPU sends every peer its piece; the (nd - N) / nd of them owned in
      other nodes cross (N = ``gpus_per_node``);
    * ``hops=2``: first an all-to-all inside the node, after which each GPU holds the node's
      sum of a 1/N slice (psi / N elements, quantized again); then an all-to-all among the
      GPUs of the same local rank in every node, where (nd - N) / nd of the slice crosses.

    So two hops send N times fewer bytes across nodes, per GPU and per node. The
    (nd - N) / nd factor is kept (it is what a link-level count measures); ZeRO++'s own
    count of qgZ, M / 4 per GPU, leaves it and the division by N out.

    Returns: ``{"per_gpu": bytes, "per_node": bytes}`` across node boundaries per step.
    Raises: ConfigError for bad counts, ``hops`` other than 1 or 2, ``gpus_per_node`` not
    dividing ``nd``.
    """
    _positive("psi", psi)
    for name, value in (("nd", nd), ("gpus_per_node", gpus_per_node), ("block", block)):
        _count(name, value)
    require_choice("hops", hops, (1, 2))
    require_real("scale_bytes", scale_bytes, strict=False)
    if nd % gpus_per_node:
        raise ConfigError(f"gpus_per_node={gpus_per_node}: must divide nd={nd}")
    quantized = psi / 2 + scale_bytes * psi / block
    crossing = (nd - gpus_per_node) / nd
    per_gpu = crossing * quantized / (gpus_per_node if hops == 2 else 1)
    return {"per_gpu": per_gpu, "per_node": per_gpu * gpus_per_node}
