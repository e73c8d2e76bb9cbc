"""The cost model's limiting cases and the paper's super-linear scaling argument (Sec 7, 10.3).

Hardware numbers here are round inputs, not measurements; expected values are
derived by hand in the comments.
"""

import math

import pytest

from zerolearn.chapters.ch06 import lesson as ch06
from zerolearn.costmodel import (
    INFINITY_STATES,
    EfficiencyCurve,
    Hardware,
    HostSide,
    Job,
    infinity_ait,
    infinity_bandwidth_GBps,
    infinity_efficiency,
    max_batch_per_gpu,
    offload_step_time,
    offload_traffic_bytes,
    qgz_cross_node_bytes,
    step_time,
    throughput_per_gpu,
    zeropp_cross_node_bytes,
)
from zerolearn.dist import ConfigError
from zerolearn.memory.fit import ActivationSpec, gpt_params, per_device_bytes
from zerolearn.memory.model import GB

pytestmark = pytest.mark.quick

HW = Hardware(tflops_achieved=100, intra_node_GBps=100, inter_node_GBps=10, gpus_per_node=8)
GPT2_1_5B = {"layers": 48, "hidden": 1600}
GPT_60B = {"layers": 75, "hidden": 8192}  # a GPT-like config of ~60B parameters (12 x 75 x 8192^2 = 60.4e9)


def job(**kw) -> Job:
    base = {"psi": 1e9, "tokens_per_gpu": 1000, "stage": 0, "nd": 4}
    return Job(**(base | kw))


def test_compute_is_six_flops_per_param_per_token():
    # 6 x 1e9 x 1000 flops at 100e12 flop/s = 0.06 s; recomputation runs 8 instead.
    assert step_time(job(), HW).compute_s == pytest.approx(0.06)
    assert step_time(job(recompute=True), HW).compute_s == pytest.approx(0.08)


def test_zero_communication_volume_leaves_compute_alone():
    # Nd = 1: nobody to talk to, so no bytes and no collectives, even with a large latency.
    t = step_time(job(nd=1), Hardware(100, 100, 10, 8, latency_s_per_collective=1.0))
    assert (t.volume_bytes, t.collectives, t.comm_s) == (0, 0, 0)
    assert t.step_s == t.compute_s


def test_volume_is_the_papers_times_the_ring_factor_in_grad_bytes():
    # Stage 0: 2 psi elements (Sec 7.1) x 2 bytes (bf16) x (4 - 1) / 4 = 3e9 bytes; intra-node 100 GB/s.
    t = step_time(job(), HW)
    assert t.volume_bytes == pytest.approx(3e9)
    assert t.comm_s == pytest.approx(0.03)
    assert step_time(job(grad_dtype="fp32"), HW).volume_bytes == pytest.approx(6e9)


def test_rings_that_leave_the_node_run_at_inter_node_bandwidth():
    # Nd = 16 > 8 GPUs per node: 2 x 1e9 x 2 x 15/16 = 3.75e9 bytes at 10 GB/s.
    assert step_time(job(nd=16), HW).comm_s == pytest.approx(0.375)


def test_infinite_bandwidth_leaves_only_latency():
    hw = Hardware(100, math.inf, math.inf, 8, latency_s_per_collective=1e-3)
    # psi 1e9 in buckets of 1e8: 10 calls a pass; an all-reduce is 2 passes (Sec 7.1): 20 calls.
    t = step_time(job(bucket_elements=100_000_000), hw)
    assert t.collectives == 20
    assert t.comm_s == pytest.approx(0.02)


def test_zero1_and_zero2_move_what_dp_moves():
    hw = Hardware(100, 100, 10, 8, latency_s_per_collective=1e-3)
    dp = step_time(job(stage=0), hw).comm_s
    assert step_time(job(stage=1), hw).comm_s == pytest.approx(dp)
    assert step_time(job(stage=2), hw).comm_s == pytest.approx(dp)


def test_zero3_communication_is_one_and_a_half_times_dp():
    hw = Hardware(100, 100, 10, 8, latency_s_per_collective=1e-3)
    dp = step_time(job(stage=0, bucket_elements=100_000_000), hw)
    z3 = step_time(job(stage=3, bucket_elements=100_000_000), hw)
    assert z3.volume_bytes == pytest.approx(1.5 * dp.volume_bytes)  # 3 psi vs 2 psi (Sec 7.2.2)
    assert z3.comm_s == pytest.approx(1.5 * dp.comm_s)


def test_comm_to_compute_ratio_halves_when_tokens_per_gpu_double():
    # Both grow with psi, so only the tokens per GPU set the ratio (without latency).
    base = step_time(job(tokens_per_gpu=1000), HW).comm_to_compute
    assert step_time(job(tokens_per_gpu=2000), HW).comm_to_compute == pytest.approx(base / 2)
    assert step_time(job(psi=1e11, tokens_per_gpu=1000), HW).comm_to_compute == pytest.approx(base)


def test_small_models_are_comm_bound_once_latency_counts():
    hw = Hardware(100, 100, 10, 8, latency_s_per_collective=1e-3)
    small = step_time(job(psi=1e7), hw).comm_to_compute
    large = step_time(job(psi=1e10), hw).comm_to_compute
    assert small > large


@pytest.mark.parametrize("tokens", [100, 100_000])  # comm-bound and compute-bound
def test_overlap_runs_from_sum_to_max(tokens):
    none = step_time(job(tokens_per_gpu=tokens, overlap=0.0), HW)
    full = step_time(job(tokens_per_gpu=tokens, overlap=1.0), HW)
    assert none.step_s == pytest.approx(none.compute_s + none.comm_s)
    assert full.step_s == pytest.approx(max(full.compute_s, full.comm_s))


def test_partial_overlap_hides_that_fraction_of_comm():
    t = step_time(job(tokens_per_gpu=100_000, overlap=0.25), HW)  # compute 6 s, comm 0.03 s
    assert t.step_s == pytest.approx(t.compute_s + 0.75 * t.comm_s)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Hardware(0, 100, 10), "tflops_achieved 0"),
    (lambda: Hardware(100, -1, 10), "intra_node_GBps -1"),
    (lambda: Hardware(100, 100, 10, 0), "gpus_per_node 0"),
    (lambda: Hardware(100, 100, 10, 8, -1.0), "latency_s_per_collective -1.0"),
    (lambda: job(overlap=1.5), "overlap 1.5"),
    (lambda: job(stage=5), "stage 5"),
    (lambda: job(nd=0), "nd 0"),
    (lambda: job(psi=-1), "psi -1"),
    (lambda: job(grad_dtype="int8"), "'int8'"),
    (lambda: EfficiencyCurve(100, 0), "b_half 0"),
])
def test_bad_input_raises_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# --- super-linear scaling (Sec 10.3, Fig 3) -------------------------------------------

def test_efficiency_curve_is_half_peak_at_b_half():
    assert EfficiencyCurve(peak_tflops=100, b_half=4)(4) == 50


def test_max_batch_is_the_largest_that_fits():
    psi = gpt_params(**GPT2_1_5B)
    # DP holds 16 psi and a fused fp32 gradient buffer of 4 psi (Sec 3.2); each checkpointed
    # sequence keeps 1024 x 1600 x 48 values of 2 bytes, and recomputing a block needs 12
    # times one layer's worth more.
    by_hand = (32 * GB - 20 * psi) // (1024 * 1600 * (48 + 12) * 2)
    b = max_batch_per_gpu(psi, 32 * GB, 0, 4, seq_len=1024, **GPT2_1_5B)
    assert b == by_hand

    def total(batch):
        spec = ActivationSpec(batch_per_gpu=batch, seq_len=1024, checkpointing=True, **GPT2_1_5B)
        return per_device_bytes(psi, 4, 0, activation=spec)["total"]

    assert total(b) <= 32 * GB < total(b + 1)


def test_dp_max_batch_does_not_change_with_nd():
    psi = gpt_params(**GPT2_1_5B)
    batches = {max_batch_per_gpu(psi, 32 * GB, 0, nd, seq_len=1024, **GPT2_1_5B) for nd in (1, 4, 64, 400)}
    assert len(batches) == 1


def test_paper_cluster_gives_each_gpu_a_sixteenth_of_800_gbps_between_nodes():
    # Sec 10.1: 800 Gbps per DGX-2 node, 16 V100s per node.
    assert ch06.DGX2.inter_node_GBps == pytest.approx(800e9 / 8 / 16 / 1e9) == 6.25
    assert ch06.DGX2.gpus_per_node == 16


def test_nothing_fits_gives_batch_zero():
    # 60B under DP with Nm = 16: 16 x 60.8e9 / 16 = 60.8 GB of model states on a 32 GB GPU.
    psi = gpt_params(**GPT_60B)
    assert max_batch_per_gpu(psi, 32 * GB, 0, 4, seq_len=1024, nm=16, **GPT_60B) == 0
    curve = EfficiencyCurve(peak_tflops=60, b_half=4)
    assert throughput_per_gpu(psi, 32 * GB, 0, 4, HW, curve, seq_len=1024, nm=16, **GPT_60B).batch_per_gpu == 0


def test_zero2_throughput_per_gpu_grows_from_64_to_400_gpus():
    """Fig 3's shape: a 60B model with Nm = 16 on 64 ... 400 V100-like GPUs (Nd = GPUs / 16)."""
    psi = gpt_params(**GPT_60B)
    dgx2 = ch06.DGX2
    curve = EfficiencyCurve(peak_tflops=60, b_half=4)  # an assumption, not the paper's curve
    gpus = [64, 128, 256, 400]
    runs = [throughput_per_gpu(psi, 32 * GB, 2, g // 16, dgx2, curve, seq_len=1024, nm=16, **GPT_60B)
            for g in gpus]
    batches = [r.batch_per_gpu for r in runs]
    per_gpu = [r.tflops_per_gpu for r in runs]
    assert batches[0] > 0 and batches == sorted(batches) and batches[-1] > batches[0]
    # Per GPU it grows while the batch does (at 256 and 400 GPUs one block's recomputation
    # and the buffers, not model states, bound the batch).
    neighbours = zip(per_gpu, per_gpu[1:], batches, batches[1:], strict=False)  # each point with the next
    assert per_gpu[-1] > per_gpu[0] and all(b > a for a, b, x, y in neighbours if y > x)
    # Super-linear: 400/64 = 6.25x the GPUs give more than 6.25x the aggregate throughput.
    aggregate_gain = (gpus[-1] * per_gpu[-1]) / (gpus[0] * per_gpu[0])
    assert aggregate_gain > gpus[-1] / gpus[0]


# ----- chapter 8: offload and ZeRO++ ----------------------------------------------------------

HOST = HostSide(pcie_GBps=10, host_adam_elements_per_s=1e9, disk_GBps=5)


def test_cpu_offload_moves_the_partitions_gradient_down_and_its_parameters_up():
    # psi = 1e9 on 4 GPUs, bf16: a partition of 2.5e8 elements, 2 bytes each way = 1e9 bytes; no disk.
    t = offload_traffic_bytes(1e9, 4, 2, "cpu")
    assert t == {"pcie": pytest.approx(1e9), "disk": 0.0, "host_elements": pytest.approx(2.5e8)}
    assert offload_traffic_bytes(1e9, 4, 2, None) == {"pcie": 0.0, "disk": 0.0, "host_elements": 0.0}


def test_disk_offload_reads_and_writes_the_optimizer_states_and_at_stage_3_the_parameters():
    # K = 12 bytes of a 2.5e8-element partition, read and written: 6e9 bytes at stages 1 and 2;
    # K = 16 gives 8e9. Stage 3 adds the bf16 shard read twice and written once, 3 x 2 x 2.5e8
    # = 1.5e9, and its two reads cross PCIe: 1e9 + 1e9.
    for stage in (1, 2):
        assert offload_traffic_bytes(1e9, 4, stage, "disk")["disk"] == pytest.approx(6e9)
    assert offload_traffic_bytes(1e9, 4, 2, "disk", k=16)["disk"] == pytest.approx(8e9)
    stage3 = offload_traffic_bytes(1e9, 4, 3, "disk")
    assert (stage3["disk"], stage3["pcie"]) == (pytest.approx(7.5e9), pytest.approx(2e9))
    assert offload_traffic_bytes(1e9, 4, 3, "cpu")["pcie"] == pytest.approx(1e9)  # parameters stay on the device


def test_offload_step_time_adds_the_host_and_dpu_hides_the_cpu_step():
    j = job(stage=2, nd=1)  # 0.06 s of compute, no collectives
    plain = offload_step_time(j, HW, HOST, None)
    assert plain.step_s == pytest.approx(step_time(j, HW).step_s) == pytest.approx(0.06)
    # cpu: 4e9 bytes over PCIe at 10 GB/s = 0.4 s; 1e9 elements at 1e9 /s = 1 s on the CPU.
    cpu = offload_step_time(j, HW, HOST, "cpu")
    assert (cpu.pcie_s, cpu.cpu_s, cpu.disk_s) == (pytest.approx(0.4), pytest.approx(1.0), 0.0)
    assert cpu.step_s == pytest.approx(0.06 + 0.4 + 1.0)
    # DPU: the CPU's 1 s runs beside the device's 0.06 s; the copies stay: 1.0 + 0.4.
    dpu = offload_step_time(j, HW, HOST, "cpu", dpu=True)
    assert dpu.step_s == pytest.approx(max(0.06, 1.0) + 0.4) and dpu.step_s < cpu.step_s
    # disk: 24e9 bytes at 5 GB/s = 4.8 s more on the host side.
    disk = offload_step_time(j, HW, HOST, "disk")
    assert disk.disk_s == pytest.approx(4.8) and disk.step_s == pytest.approx(0.06 + 0.4 + 1.0 + 4.8)


def test_dpu_hides_all_of_a_host_step_shorter_than_the_devices():
    fast = HostSide(pcie_GBps=float("inf"), host_adam_elements_per_s=1e12, disk_GBps=float("inf"))
    t = offload_step_time(job(stage=1, nd=1), HW, fast, "cpu", dpu=True)
    assert t.cpu_s == pytest.approx(1e-3) and t.step_s == pytest.approx(0.06)


def test_offload_refuses_what_it_cannot_mean():
    with pytest.raises(ConfigError, match="stage 0"):
        offload_traffic_bytes(1e9, 4, 0, "cpu")
    with pytest.raises(ConfigError, match="offload"):
        offload_traffic_bytes(1e9, 4, 2, "nvme")
    with pytest.raises(ConfigError, match="dpu"):
        offload_step_time(job(), HW, HOST, None, dpu=True)
    with pytest.raises(ConfigError, match="disk_GBps"):
        HostSide(pcie_GBps=10, host_adam_elements_per_s=1e9, disk_GBps=0)


def test_zero3_sends_three_model_sizes_across_nodes_and_zeropp_about_a_quarter():
    psi, m = 1e9, 2e9  # fp16: M = 2 bytes x psi
    plain = zeropp_cross_node_bytes(psi, 16, 8)
    assert plain["total"] == pytest.approx(3 * m) and plain["hpz_extra_bytes"] == 0
    # scale_bytes=0 is the paper's rounded count: 0.5M + 0 + 0.25M = 0.75M, 4x less.
    all3 = zeropp_cross_node_bytes(psi, 16, 8, qwz=True, hpz=True, qgz=True, scale_bytes=0)
    assert (all3["forward_gather"], all3["backward_gather"], all3["gradients"]) == (
        pytest.approx(0.5 * m), 0.0, pytest.approx(0.25 * m))
    assert plain["total"] / all3["total"] == pytest.approx(4)
    # one fp32 scale per 256 elements adds 4 / 256 bytes per element to each quantized collective
    scaled = zeropp_cross_node_bytes(psi, 16, 8, qwz=True, hpz=True, qgz=True)
    assert scaled["total"] - all3["total"] == pytest.approx(2 * 4 * psi / 256)
    assert scaled["hpz_extra_bytes"] == pytest.approx(m / 8)  # the secondary partition inside a node of 8


def test_nothing_crosses_a_node_boundary_inside_one_node():
    assert zeropp_cross_node_bytes(1e9, 8, 8)["total"] == 0
    assert zeropp_cross_node_bytes(1e9, 16, 8, hpz=True)["backward_gather"] == 0


# ----- ZeRO-Infinity's bandwidth analysis (arXiv 2104.07857, Sec 4) and qgZ's hops ----------------
def test_infinity_efficiency_and_bandwidth_are_inverse():
    assert len(INFINITY_STATES) == 3  # parameters and gradients, optimizer states, activation checkpoints
    for state in INFINITY_STATES:
        for batch, hidden in ((1, 1024), (4, 8192)):
            ait = infinity_ait(state, batch_per_gpu=batch, hidden=hidden)
            for eff in (0.1, 0.5, 0.9):
                assert infinity_efficiency(ait, infinity_bandwidth_GBps(eff, ait)) == pytest.approx(eff)
            # more bandwidth, more efficiency; at the peak's own rate (flops per byte x GB/s = peak) exactly half
            assert infinity_efficiency(ait, 10) < infinity_efficiency(ait, 20) < 1
            assert infinity_efficiency(ait, 70e12 / ait / 1e9) == pytest.approx(0.5)


def test_infinity_ait_follows_the_bytes_moved_per_parameter():

    # 8 bytes per parameter for parameters and gradients against 32 for optimizer states: 4x the intensity
    pg = infinity_ait("parameters and gradients", batch_per_gpu=2, seq=512)
    assert pg == 2 * 512 == 4 * infinity_ait("optimizer states", batch_per_gpu=2, seq=512)
    # checkpoints: independent of the batch, linear in width and in the checkpoint interval
    ckpt = infinity_ait("activation checkpoints", batch_per_gpu=1, hidden=2048)
    assert ckpt == infinity_ait("activation checkpoints", batch_per_gpu=64, hidden=2048)
    assert infinity_ait("activation checkpoints", hidden=4096, ci=2) == 4 * ckpt


def test_the_papers_bandwidth_statements():

    # Sec 4.2: about 70 GB/s for parameters and gradients keeps over half the peak even at batch 1;
    # about 1.5 TB/s for optimizer states keeps 90% at batch 2 per GPU
    assert infinity_efficiency(infinity_ait("parameters and gradients", batch_per_gpu=1), 70) > 0.5
    assert infinity_efficiency(infinity_ait("parameters and gradients", batch_per_gpu=1), 60) < 0.5
    assert infinity_efficiency(infinity_ait("optimizer states", batch_per_gpu=2), 1500) > 0.9


def test_qgz_two_hops_send_n_times_fewer_bytes_across_nodes():

    for nd, n in ((4, 2), (16, 8), (64, 16)):
        one, two = qgz_cross_node_bytes(1e9, nd, n, hops=1), qgz_cross_node_bytes(1e9, nd, n, hops=2)
        assert one["per_gpu"] == pytest.approx(n * two["per_gpu"])
        for hop in (one, two):
            assert hop["per_node"] == pytest.approx(n * hop["per_gpu"])
        # one hop is ZeRO++'s per-GPU count (M / 4 with scales) times the share owned in other nodes
        headline = zeropp_cross_node_bytes(1e9, nd, n, qgz=True)["gradients"]
        assert one["per_gpu"] == pytest.approx(headline * (nd - n) / nd)
    assert qgz_cross_node_bytes(1e9, 8, 8)["per_gpu"] == 0  # one node: nothing crosses


@pytest.mark.parametrize("call, message", [
    (lambda: infinity_ait("weights"), "state"),
    (lambda: infinity_ait("optimizer states", batch_per_gpu=0),
     "batch_per_gpu"),
    (lambda: infinity_bandwidth_GBps(1.0, 1024), "efficiency=1.0"),
    (lambda: infinity_efficiency(1024, 0), "bandwidth_GBps"),
    (lambda: qgz_cross_node_bytes(1e9, 16, 8, hops=3), "hops"),
    (lambda: qgz_cross_node_bytes(1e9, 16, 3), "gpus_per_node=3"),
])
def test_bad_bandwidth_inputs_are_config_errors(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
