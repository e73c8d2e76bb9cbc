"""The paper map (book/paper_map.md) is generated from code, covers the paper, and its numbers hold.

The expected values here are recomputed from the paper's formulas (Sec 3, 5, 6, 9,
10.1, 10.2) with plain arithmetic, not copied from the page, and compared with both the
page's computed values and the paper's printed numbers within their rounding. The map's
status rule (its header) is applied to every row with a computation.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zerolearn import papermap
from zerolearn.papermap import REPRODUCED, SHAPE_ONLY, Row, Stated, rows
from zerolearn.papermap.checks import paper_rule_problems

pytestmark = pytest.mark.quick

PAGE = Path(__file__).resolve().parent.parent / "book" / "paper_map.md"
GB = 1e9  # the paper's decimal GB


def test_committed_page_equals_render():
    assert PAGE.read_text() == papermap.render(), (
        "book/paper_map.md differs from zerolearn.papermap.render(): a computed value changed. "
        "Run `make paper-map` and commit the page.")


def test_render_gives_every_row_one_line_of_its_table_in_order():
    # (Whether render() is deterministic: test_committed_page_equals_render compares it with the
    # page another process rendered.)
    lines = [line for line in papermap.render().splitlines() if line.startswith("| ")]
    firsts = [line.split("|")[1].strip() for line in lines]
    assert [f for f in firsts if f in ("paper", "source")] == ["paper", "source"]  # the two tables' headers
    body = [f for f in firsts if f not in ("paper", "source")]
    assert len(body) == len(papermap.rows()) > 40
    assert body == [r.section for r in papermap.rows()]


def test_page_covers_sections_3_and_5_to_10_and_tables_1_to_3():
    refs = {ref for row in papermap.rows() for ref in row.refs()}
    tops = {ref.split(".")[0] for ref in refs}
    for sec in ("Sec 3", "Sec 5", "Sec 6", "Sec 7", "Sec 8", "Sec 9", "Sec 10", "Table 1", "Table 2", "Table 3"):
        assert sec in tops, f"no row cites {sec}"
    for sub in ("Sec 3.1", "Sec 3.2", "Sec 5.1", "Sec 5.2", "Sec 5.3", "Fig 1", "Sec 6.1", "Sec 6.2", "Sec 6.3",
                "Sec 7.1", "Sec 7.2.1", "Sec 7.2.2", "Sec 10.1", "Sec 10.2", "Sec 10.3", "Sec 10.4", "Sec 10.5",
                "Sec 10.6"):
        assert sub in refs, f"no row cites {sub}"


def test_every_row_has_a_known_status_and_not_reproduced_rows_say_why():
    rows = papermap.rows()
    assert len({r.key for r in rows}) == len(rows)
    for r in rows:
        assert r.status in papermap.STATUSES, r
        assert r.claim and r.computed and r.where, r
        if r.status != papermap.REPRODUCED:
            assert r.why, f"{r.key}: status {r.status!r} without a reason"


def test_both_boxes_are_myst_admonitions():
    page = papermap.render()
    assert page.startswith("# Paper map\n")
    for title in ("Reduce and broadcast, or reduce-scatter and all-gather",
                  "Where the paper and other sources disagree"):
        assert f"```{{admonition}} {title}\n:class: note\n" in page


def test_fig1_matches_the_paper():
    """Fig 1: 7.5B at Nd = 64 is 120, 31.4, 16.6, 1.9 GB (Sec 5: 16, 4 + 12/Nd, 2 + 14/Nd, 16/Nd bytes)."""
    psi, nd = 7.5e9, 64
    expected = [16 * psi, (4 + 12 / nd) * psi, (2 + 14 / nd) * psi, 16 * psi / nd]
    printed = [120, 31.4, 16.6, 1.9]
    values = papermap.find("fig1").values
    for name, want, paper in zip(("DP", "P_os", "P_os+g", "P_os+g+p"), expected, printed, strict=True):
        assert values[name] == pytest.approx(want / GB)
        assert round(values[name], 1) == pytest.approx(paper)  # the paper prints one decimal


def test_sec3_gpt2_numbers():
    """Sec 3.1: 16 bytes per parameter, 24 GB for 1.5B; Sec 3.2: ~60 GB of activations at seq 1K, batch 32."""
    assert papermap.find("mixed-adam").values["gpt2_states_gb"] == pytest.approx((2 + 2 + 12) * 1.5e9 / GB)
    act = papermap.find("activations").values["act_gb"]
    assert act == pytest.approx(12 * 1600 * 32 * 1024 * 48 * 2 / GB)
    assert 55 <= act <= 65  # "about 60 GB"


def test_gpt2_batch32_does_not_fit_under_dp():
    """Sec 3: GPT-2 1.5B cannot train on one 32 GB GPU, with or without checkpointing."""
    values = papermap.find("dp-gpt2-batch32").values
    assert values["dp_full_gb"] > 32 and values["dp_ck_gb"] > 32


def test_sec6_1_at_the_papers_batch_is_twice_its_figures_and_says_so():
    """Sec 6.1: 100B at batch 32, seq 1K, Nm = 16: ~33 GB of checkpoints per GPU become ~2 GB. One b s h
    checkpoint per block gives twice that at batch 32 (the paper's figures match batch 16): in shape only,
    with the paper's own inconsistency (Sec 3.2's ~60 GB at batch 32) named."""
    row = papermap.find("pa")
    for batch, key in ((32, "ckpt_gb"), (16, "ckpt16_gb")):
        ckpt = 125 * 8192 * batch * 1024 * 2  # layers x hidden x batch x seq x fp16 bytes
        assert row.values[key] == pytest.approx(ckpt / GB)
    assert row.values["pa_gb"] == pytest.approx(row.values["ckpt_gb"] / 16)
    assert round(row.values["ckpt16_gb"]) in (33, 34) and round(row.values["pa16_gb"]) == 2
    assert not row.paper["ckpt_gb"].holds(row.values["ckpt_gb"])
    assert row.status == SHAPE_ONLY and "Sec 3.2" in row.inconsistency
    assert papermap.find("activations-checkpointed").status == SHAPE_ONLY


def test_sec9_days_scale_bert_large_by_the_parameters():
    """Sec 9: BERT-Large's 67 minutes on 1024 GPUs x (1T / 330M, about 3000x) = about 140 days."""
    days = papermap.find("trillion-time").values["days"]
    assert days == pytest.approx(67 * 1e12 / 330e6 / (60 * 24))
    assert round(days) == 141 and abs(days - 140) / 140 < 0.03


def test_sec10_2_compares_links_24x():
    """Sec 10.2: 300 GB/s per NVSwitch link against 12.5 GB/s per InfiniBand EDR link."""
    assert papermap.find("mp-across-nodes").values["link_gap"] == pytest.approx(300 / 12.5) == 24


# ----- the status rule: reproduced only at the paper's own inputs, within a stated tolerance ----------
def test_header_states_the_status_rule():
    head = papermap.render().split("| paper ")[0]
    assert "**The status rule.**" in head and "paper's own stated inputs" in head and "tolerance" in head
    assert "paper inconsistency" in head


def test_every_paper_row_keeps_the_status_rule():
    """Every row with a computation: reproduced rows hold each of the paper's numbers within their stated
    tolerance at the paper's inputs; rows that change an input or the scheme are not reproduced."""
    paper_rows = [r for r in rows() if r.section.split()[0] in ("Sec", "Fig", "Table")]
    assert len(paper_rows) > 25
    assert paper_rule_problems(paper_rows) == []
    for r in paper_rows:
        if r.status == REPRODUCED and r.values:
            assert r.paper and not r.changed, r.key


def test_the_rule_fails_a_reproduced_row_that_misses_its_tolerance():
    ok = Row("x", "Sec 6.1", "about 33 GB", "33.6 GB", "ch. 5", REPRODUCED, values={"gb": 33.6},
             paper={"gb": Stated(33, 0.10)})
    assert paper_rule_problems([ok]) == []
    off = replace(ok, values={"gb": 67.1})
    problem, = paper_rule_problems([off])
    assert problem == "x says 'reproduced' but gb = 67.1 is not within 10% of 33"
    assert paper_rule_problems([replace(ok, changed="the batch")]) == [
        "x says 'reproduced' though the book changed the batch"]
    assert paper_rule_problems([replace(ok, paper={})]) == ["x says 'reproduced' with no number of the paper's to hold"]
    shape = replace(ok, status=SHAPE_ONLY, why="why")
    assert paper_rule_problems([shape]) == ["x says 'reproduced in shape only' while its numbers hold at the "
                                            "paper's inputs"]
    assert paper_rule_problems([replace(shape, changed="the scheme")]) == []
    below = replace(ok, values={"r": 0.083}, paper={"r": Stated(0.1, kind="below")})
    assert paper_rule_problems([below]) == [] and paper_rule_problems([replace(below, values={"r": 0.12})])


def test_sec7_stage3_moves_one_and_a_half_times_dp():
    assert papermap.find("comm-posgp").values["factor"] == pytest.approx(3 / 2)


def test_sec9_trillion_parameters_need_16_gb_per_gpu():
    """Sec 9: 16 bytes x 1e12 parameters over 1024 GPUs, 16 TB / 1024 = 15.6 GB, "16 GB"."""
    gb = papermap.find("trillion").values["gb"]
    assert gb == pytest.approx(16 * 1e12 / 1024 / GB)
    assert round(gb) == 16


def test_sec10_1_bandwidth_is_6_25_gb_per_s_per_gpu():
    """Sec 10.1: 800 Gbps per DGX-2 node of 16 GPUs."""
    assert papermap.find("setup").values["GBps"] == pytest.approx(800 / 8 / 16) == 6.25


def test_sec10_2_aggregate_and_table2_measured_headroom():
    assert papermap.find("100b").values["pflops"] == pytest.approx(400 * 38 / 1000)  # "over 15 PFlops"
    # Table 2: 6.2B measured under P_os at Nd = 64 leaves room for residual states in 32 GB.
    assert papermap.find("table2-measured").values["states_gb"] == pytest.approx((4 + 12 / 64) * 6.2e9 / GB)


def test_tables_1_and_2_agree_with_the_print():
    """Table 1 within one unit of the last printed digit (under 2.5%); Table 2 within its ~3% rounding."""
    for key in ("table1-7.5B", "table1-128B", "table1-1T"):
        assert papermap.find(key).values["worst_rel"] < 0.025, key
    t2 = papermap.find("table2-theory").values
    assert t2["worst_rel"] < 0.03
    assert t2["P_os"] == pytest.approx(32e9 / (4 + 12 / 64) / 1e9)  # 7.6B


def test_successors_have_their_own_table_after_the_papers():
    page = papermap.render()
    assert page.index("## Beyond the paper") > page.index("Where the paper and other sources disagree")
    sources = [r.section for r in papermap.rows()[-12:]]
    assert sources == ["ZeRO-Offload"] * 3 + ["ZeRO-Infinity"] * 5 + ["ZeRO++"] * 4
    assert "```{admonition} 32 trillion parameters: 32 nodes, not one\n:class: note\n" in page


def test_zero_infinity_bandwidth_needs_follow_its_formulas():
    """Sec 4: efficiency = ait bw / (ait bw + 70 TFLOP/s); ait = seq x batch for parameters and
    gradients, a quarter of that for optimizer states, 24 x width per checkpoint a layer."""
    needs = papermap.find("infinity-bandwidth-needs").values
    assert needs["pg"] * 1e9 * 1024 == pytest.approx(70e12)  # half the peak: transfer time = compute time
    assert needs["os"] * 1e9 * 512 == pytest.approx(9 * 70e12)  # 90%: transfer a ninth of compute
    assert needs["os_at_1500"] == pytest.approx(1500e9 * 512 / (1500e9 * 512 + 70e12))
    assert needs["ac_2k"] == pytest.approx(4 * needs["ac_8k"])
    assert needs["ac_2k"] * 1e9 * 24 * 2048 == pytest.approx(70e12)


def test_zero_offload_keeps_two_bytes_a_parameter_on_the_gpu():
    """ZeRO-2 + CPU offload: 2-byte parameters on the device; 4-byte gradients and K = 12 on the host."""
    assert papermap.find("offload-placement").values == {"device": 2, "host": 4 + 12}
    values = papermap.find("offload-13b").values
    assert values["dp_b"] == pytest.approx(32e9 / 16 / 1e9) and values["offload_b"] == pytest.approx(32e9 / 2 / 1e9)


def test_zero_infinity_32_trillion_is_a_terabyte_a_gpu_on_512():
    assert papermap.find("infinity-32t").values["tb_per_gpu"] == pytest.approx(16 * 32e12 / 512 / 1e12) == 1.0
    # disk offload at stage 3: nothing on the GPU between uses; 4 bytes of gradient a parameter
    # in host memory and 2 + 12 on disk, each over 16 GPUs.
    values = papermap.find("infinity-1t").values
    assert values == {"device_gb": 0, "host_gb": pytest.approx(4 * 1e12 / 16 / GB),
                      "disk_gb": pytest.approx(14 * 1e12 / 16 / GB)}


def test_zeropp_counts_half_a_quarter_and_four_times_less():
    # int8 + one fp32 scale per 256: (1 + 4/256) / 2 of fp16; int4: (0.5 + 4/256) / 2; 3M / 0.75M = 4.
    assert papermap.find("zeropp-qwz").values["ratio"] == pytest.approx((1 + 4 / 256) / 2)
    assert papermap.find("zeropp-qgz").values["ratio"] == pytest.approx((0.5 + 4 / 256) / 2)
    assert papermap.find("zeropp-hpz").values["extra"] == pytest.approx(1 / 8)
    values = papermap.find("zeropp-4x").values
    assert values["codes_only"] == pytest.approx(4)
    assert values["with_scales"] == pytest.approx(6 / (1 + 4 / 256 + 0.5 + 4 / 256))


# ----- statuses follow from what is computed and measured (chapter 8's tables) --------------------
def test_status_problems_names_a_reproduced_row_whose_measurement_disagrees():
    from zerolearn.papermap.checks import Check, status_problems

    row = Row("zeropp-qgz", "ZeRO++", "a quarter", "0.258", "ch. 8", REPRODUCED)
    off = Check("zeropp-qgz", "gradients", computed=0.258, measured=0.129, tolerance=0.02)
    near = Check("zeropp-qgz", "gradients", computed=0.258, measured=0.262, tolerance=0.02)
    assert status_problems([row], [near]) == []
    problem, = status_problems([row], [near, off])
    assert problem.startswith("zeropp-qgz says 'reproduced' but gradients: computed 0.258, measured 0.129")
    shape = Row("zeropp-qgz", "ZeRO++", "a quarter", "0.258", "ch. 8", SHAPE_ONLY, "why")
    assert status_problems([shape], [off]) == []
    assert status_problems([shape], [near]) == ["zeropp-qgz says 'reproduced in shape only' while every check agrees"]


@pytest.mark.slow
def test_successor_statuses_follow_the_measured_runs():
    from zerolearn.experiments.offload import offload_table
    from zerolearn.experiments.zeropp import zeropp_table
    from zerolearn.papermap.checks import status_problems, successor_checks

    checks = successor_checks(zeropp_table(4, 2, steps=1, d_model=32), offload_table(2, 2, steps=1, d_model=32),
                              world_size=4, node_ranks=2)
    assert status_problems(rows(), checks) == []
    # every successor row marked reproduced rests on at least one measurement
    checked = {c.key for c in checks}
    assert {r.key for r in rows() if r.status == REPRODUCED and r.section in ("ZeRO-Offload", "ZeRO-Infinity",
                                                                              "ZeRO++")} <= checked
    # the link model's qgZ figure is the two hops' count, not ZeRO++'s quarter
    hops = next(c for c in checks if c.key == "zeropp-qgz-hops")
    assert hops.agrees and not next(c for c in checks if c.key == "zeropp-qgz").agrees
