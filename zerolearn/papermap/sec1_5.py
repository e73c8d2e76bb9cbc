"""The paper map's claims of Sec 1-5, Fig 1 and Tables 1-2: the memory wall, ZeRO-DP's
three stages and what they hold per GPU."""

from __future__ import annotations

from zerolearn.chapters.ch06.lesson import DGX2
from zerolearn.memory import activation_bytes, fused_buffer_bytes, max_model_params, model_state_bytes
from zerolearn.memory.fit import ActivationSpec, gpt_params, per_device_bytes, smallest_fit
from zerolearn.memory.model import FIGURE1_GB, GB, STAGE_NAMES, TABLE1_GB, TABLE2_THEORETICAL_B, V100_BYTES
from zerolearn.papermap.base import CH, GPT2_1_5B, GPT_100B, NOT_REPRODUCIBLE, REPRODUCED, SEQ, SHAPE_ONLY, Row, Stated
from zerolearn.papermap.text import _b, _fit_text, _gb, _sig, _states

__all__ = ["ABOUT", "PRINT", "memory_rows"]

ABOUT = 0.10
"""The tolerance the map gives the paper's "about" and "around": 10% of the number stated."""
PRINT = 0.025
"""The tolerance for a number the paper prints to 2-3 digits (Fig 1, Table 1): 2.5%."""
WORST = "every cell's relative difference from the print"


def _sec1_2() -> list[Row]:
    dp_max = max_model_params(V100_BYTES, 1, 0)
    ratio_40b = DGX2.intra_node_GBps / DGX2.inter_node_GBps
    link_gap = DGX2.intra_node_GBps / 12.5  # Sec 10.2: 12.5 GB/s per InfiniBand EDR link
    return [
        Row("dp-limit", "Sec 1, Sec 10.4", "data parallelism runs out of memory beyond about 1.4B parameters "
            "on 32 GB GPUs", f"`max_model_params(32 GB, Nd=1, DP)`: {_b(dp_max)} with model states alone (16 bytes "
            "a parameter); activations and buffers lower it", f"{CH[0]}; {CH[1]}", SHAPE_ONLY,
            "the formula gives the upper bound; 1.4B is a measurement on V100s with the paper's batch and "
            "framework buffers", {"dp_max_B": dp_max / 1e9}, paper={"dp_max_B": Stated(1.4, ABOUT)},
            changed="what is counted: model states alone, an upper bound"),
        Row("mp-across-nodes", "Sec 1, Sec 10.2", "Megatron-LM model parallelism across two DGX-2 nodes: a 40B "
            "model at about 5 TFlops per GPU, under 5% of peak (Sec 1); NVSwitch's 300 GB/s per link inside a node "
            "against InfiniBand EDR's 12.5 GB/s per link between nodes (Sec 10.2)",
            f"per link, the paper's numbers: 300 / 12.5 = {_sig(link_gap)}x; per GPU, as `ch06.DGX2` models the "
            f"cluster (300 GB/s inside a node, Sec 10.1's 800 Gbps per node shared by 16 GPUs between nodes): "
            f"{DGX2.intra_node_GBps:g} against {DGX2.inter_node_GBps:g} GB/s, {_sig(ratio_40b)}x",
            f"{CH[6]}", NOT_REPRODUCIBLE,
            "the cost model does not model MP's own traffic (`costmodel.Job`) nor kernel efficiency; "
            "it needs the cluster", {"link_gap": link_gap, "gpu_gap": ratio_40b},
            paper={"link_gap": Stated(300 / 12.5)}),
        Row("dp-replicates", "Sec 2.1", "data parallelism keeps every model state on every GPU",
            f"`model_state_bytes(psi, Nd, DP)` is 16 psi at every Nd: {_gb(_states(7.5e9, 1, 0))} for 7.5B at "
            f"Nd = 1 and {_gb(_states(7.5e9, 1024, 0))} at Nd = 1024", f"{CH[1]}", REPRODUCED,
            values={"nd1024_over_nd1": _states(7.5e9, 1024, 0) / _states(7.5e9, 1, 0)},
            paper={"nd1024_over_nd1": Stated(1.0)}),
    ]


def _sec3_4() -> list[Row]:
    gpt2 = gpt_params(**GPT2_1_5B)
    ck = ActivationSpec(batch_per_gpu=32, seq_len=SEQ, checkpointing=True, **GPT2_1_5B)
    full = ActivationSpec(batch_per_gpu=32, seq_len=SEQ, checkpointing=False, **GPT2_1_5B)
    dp_ck = per_device_bytes(gpt2, 1, 0, dtype="fp16", activation=ck)["total"]
    dp_full = per_device_bytes(gpt2, 1, 0, dtype="fp16", activation=full)["total"]
    fit_ck = smallest_fit(gpt2, V100_BYTES, dtype="fp16", activation=ck)
    fit_full = smallest_fit(gpt2, V100_BYTES, dtype="fp16", activation=full)
    act, act_ck = (activation_bytes(batch=32, seq_len=SEQ, checkpointing=c, **GPT2_1_5B) for c in (False, True))
    act100 = activation_bytes(batch=32, seq_len=SEQ, checkpointing=True, **GPT_100B)
    return [
        Row("mixed-adam", "Sec 3.1", "mixed-precision Adam holds 2 + 2 + 12 = 16 bytes a parameter; GPT-2 1.5B "
            "needs at least 24 GB though its fp16 weights are 3 GB",
            f"`model_state_bytes(1.5e9, 1, DP)`: {_gb(_states(1.5e9, 1, 0))}, of which fp16 params "
            f"{_gb(model_state_bytes(1.5e9, 1, 0)['params'])}", f"{CH[0]} (bytes measured from the tensors)",
            REPRODUCED, values={"gpt2_states_gb": _states(1.5e9, 1, 0) / GB,
                                "gpt2_params_gb": model_state_bytes(1.5e9, 1, 0)["params"] / GB},
            paper={"gpt2_states_gb": Stated(24), "gpt2_params_gb": Stated(3)}),
        Row("activations", "Sec 3.2", "activations of GPT-2 1.5B at sequence 1K and batch 32: about 60 GB",
            f"`activation_bytes` (12 h b s L values of 2 bytes, 48 x 1600): {_gb(act)}", f"{CH[0]}; {CH[6]}",
            REPRODUCED, values={"act_gb": act / GB}, paper={"act_gb": Stated(60, ABOUT)}),
        Row("activations-checkpointed", "Sec 3.2", "with activation checkpointing, about 8 GB for GPT-2 1.5B; a "
            "100B GPT-like model at batch 32 still needs about 60 GB",
            f"`activation_bytes(checkpointing=True)`, one checkpoint of b s h values per block: {_gb(act_ck)} for "
            f"GPT-2 at batch 32; the book's 100B shape (125 x 8192) at batch 32: {_gb(act100)}",
            f"{CH[0]}; {CH[5]}; {CH[6]}", SHAPE_ONLY,
            "the 8 GB comes from no formula the paper gives, and the 100B model's shape is the book's (the "
            "paper's shapes are in Table 4, an image)",
            values={"act_ck_gb": act_ck / GB, "act100_ck_gb": act100 / GB},
            paper={"act_ck_gb": Stated(8, ABOUT), "act100_ck_gb": Stated(60, ABOUT)},
            changed="the scheme: one checkpoint per block, as Sec 6.1 and Sec 8 count, where Sec 3.2 cites "
            "checkpointing that keeps about the square root of the activations",
            inconsistency="Sec 3.2 gives the 100B model about 60 GB of checkpoints at batch 32, Sec 6.1 about "
            "33 GB at the same batch"),
        Row("dp-gpt2-batch32", "Sec 3", "GPT-2 1.5B cannot be trained on one 32 GB GPU",
            f"`per_device_bytes` with residual states (activations, one block's recompute, the fused fp32 "
            f"buffer), DP, batch 32, the 48 x 1600 shape's {gpt_params(**GPT2_1_5B) / 1e9:.2f}B parameters: "
            f"{_gb(dp_full)} without checkpointing, {_gb(dp_ck)} with it (ch. 0 uses the round 1.5B: a GB "
            "less); neither fits. "
            f"`smallest_fit`: with checkpointing {_fit_text(fit_ck)}; without, {_fit_text(fit_full)}",
            f"{CH[0]}; {CH[6]}", REPRODUCED, values={"dp_full_gb": dp_full / GB, "dp_ck_gb": dp_ck / GB},
            paper={k: Stated(32, kind="above", label="GB per GPU") for k in ("dp_full_gb", "dp_ck_gb")}),
        Row("buffers", "Sec 3.2", "a flat fp32 buffer fusing all gradients of 1.5B parameters takes 6 GB",
            f"`fused_buffer_bytes(1.5e9)`: {_gb(fused_buffer_bytes(1.5e9))}", f"{CH[0]}; {CH[5]}", REPRODUCED,
            values={"buffer_gb": fused_buffer_bytes(1.5e9) / GB}, paper={"buffer_gb": Stated(6)}),
        Row("fragmentation", "Sec 3.2, Sec 6.3", "fragmentation: in extreme cases, out of memory with over 30% "
            "of memory still available (Sec 3.2); MD (contiguous pools for long-lived tensors) prevents it "
            "(Sec 6.3)",
            "no formula (fit.per_device_bytes adds nothing for it); a trace of two real training steps replayed "
            "through a caching-allocator model (`residual.defrag`) fails with over 40% free without MD and fits "
            "with it", f"{CH[5]}; {CH[6]} (explorer)", SHAPE_ONLY,
            "the allocator is a model of torch's, replayed on a CPU trace; the paper's 30% is a GPU observation"),
        Row("plan", "Sec 4", "two groups of optimizations: ZeRO-DP for model states, ZeRO-R for residual states",
            "the rows of Sec 5-8 below", "ch. 1-5", REPRODUCED),
    ]


def _sec5() -> list[Row]:
    fig1 = [_states(7.5e9, 64, s) for s in range(4)]
    red = {s: _states(1, 1, 0) / _states(1, 64, s) for s in (1, 2, 3)}
    limit = {s: _states(1, 1, 0) / _states(1, 2**40, s) for s in (1, 2)}
    return [
        Row("pos", "Sec 5.1, Fig 1", "$P_{os}$: $4\\Psi + K\\Psi/N_d$, a 4x reduction",
            f"{_sig(red[1])}x at Nd = 64, {_sig(limit[1])}x as Nd grows", f"{CH[2]}", REPRODUCED,
            values={"limit": limit[1]}, paper={"limit": Stated(4, 1e-6)}),
        Row("posg", "Sec 5.2, Fig 1", "$P_{os+g}$: $2\\Psi + (2+K)\\Psi/N_d$, an 8x reduction; gradients "
            "reduce-scattered in buckets during backward",
            f"{_sig(red[2])}x at Nd = 64, {_sig(limit[2])}x as Nd grows", f"{CH[3]}", REPRODUCED,
            values={"limit": limit[2]}, paper={"limit": Stated(8, 1e-6)}),
        Row("posgp", "Sec 5.3, Fig 1", "$P_{os+g+p}$: $(2+2+K)\\Psi/N_d$, a reduction by $N_d$",
            f"{_sig(red[3])}x at Nd = 64", f"{CH[4]}", REPRODUCED, values={"at_64": red[3]},
            paper={"at_64": Stated(64)}),
        Row("fig1", "Fig 1", "7.5B parameters, $N_d$ = 64: "
            + ", ".join(f"{FIGURE1_GB[s]:g}" for s in range(4)) + " GB per GPU (DP to $P_{os+g+p}$)",
            "`model_state_bytes(7.5e9, 64, stage)`: " + ", ".join(_gb(b) for b in fig1),
            "ch. 2-4 (exercises); ch. 6 (trend measured, simulated Nd); appendix 6a (memory explorer); "
            "`python -m zerolearn.memory`", REPRODUCED,
            values={STAGE_NAMES[s]: fig1[s] / GB for s in range(4)},
            paper={STAGE_NAMES[s]: Stated(FIGURE1_GB[s], PRINT) for s in range(4)}),
    ]


def _table1() -> list[Row]:
    rows_ = []
    for psi, label in ((7_500_000_000, "7.5B"), (128_000_000_000, "128B"), (1_000_000_000_000, "1T")):
        printed = TABLE1_GB[psi]
        worst = max(abs(_states(psi, nd, s + 1) / GB - p) / p for nd, row in printed.items() for s, p in enumerate(row))
        at = [_states(psi, 1024, s) for s in (1, 2, 3)]
        rows_.append(Row(f"table1-{label}", "Table 1", f"{label}: GB per GPU of each stage for Nd = 1 to 1024; "
                         f"at 1024: {', '.join(f'{p:g}' for p in printed[1024])}",
                         f"at Nd = 1024: {', '.join(_gb(b) for b in at)}; all {3 * len(printed)} cells within "
                         f"{_sig(100 * worst)}% of the print", f"{CH[4]}; {CH['6sim']}", REPRODUCED,
                         values={"worst_rel": worst,
                                 **{STAGE_NAMES[s]: b / GB for s, b in zip((1, 2, 3), at, strict=True)}},
                         paper={"worst_rel": Stated(PRINT, kind="below", label=WORST)}))
    return rows_


def _table2() -> list[Row]:
    t2 = {key: [max_model_params(V100_BYTES, key[1] // key[0], s, nm=key[0]) / 1e9 for s in range(4)]
          for key in TABLE2_THEORETICAL_B}
    worst2 = max(abs(c - p) / p for key, printed in TABLE2_THEORETICAL_B.items()
                 for c, p in zip(t2[key], printed, strict=True))
    measured = _states(6.2e9, 64, 1)
    return [
        Row("table2-theory", "Table 2", "theoretical largest model on 32 GB V100s, Nd = 64: MP 1 on 64 GPUs "
            "2B, 7.6B, 14.4B, 128B (DP to $P_{os+g+p}$); MP 16 on 1024 GPUs up to 2T",
            "`max_model_params`: MP 1 " + ", ".join(f"{x:.1f}B" for x in t2[(1, 64)]) + "; MP 16 "
            + ", ".join(f"{x:.1f}B" for x in t2[(16, 1024)]) + f"; all cells within {_sig(100 * worst2)}% "
            "(the print scales rounded values: 0.5T, 1T, 2T for 512B, 1,024B, 2,048B)", f"{CH[6]}", REPRODUCED,
            values={"worst_rel": worst2, **{STAGE_NAMES[s]: x for s, x in enumerate(t2[(1, 64)])}},
            paper={"worst_rel": Stated(0.03, kind="below", label=WORST)}),
        Row("table2-measured", "Table 2", "measured largest model with $P_{os}$, MP 1 on 64 GPUs: 6.2B, "
            "against 7.6B in theory", f"6.2B under $P_{{os}}$ at Nd = 64 holds {_gb(measured)} of model states, "
            f"leaving {_gb(V100_BYTES - measured)} ({_sig(100 * (1 - measured / V100_BYTES))}%) for residual "
            "states (Table 2's caption reads the measured size as matching the theoretical bound)",
            f"{CH['6sim']} (bytes per parameter measured)", SHAPE_ONLY,
            "the largest size that runs needs 64 V100s and the paper's shapes and batch (its Tables 4-10, images)",
            {"states_gb": measured / GB}),
    ]


def memory_rows() -> list[Row]:
    """The rows of Sec 1-5, Fig 1, Tables 1 and 2, in the paper's order."""
    return _sec1_2() + _sec3_4() + _sec5() + _table1() + _table2()
