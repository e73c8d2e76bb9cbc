"""One table formatter: numbers are printed as the caller formatted them, columns line up."""

import pytest

from zerolearn.memory.model import stage_title
from zerolearn.report import format_rank_table, format_table
from zerolearn.tables import cell, kib, text_table

pytestmark = pytest.mark.quick


def test_cells_keep_the_callers_precision_and_ints_get_separators():
    assert cell(1_070) == "1,070" and cell("1.50") == "1.50" and cell(0.1) == "0.1"
    assert cell(None) == "-" and cell(True) == "True"
    table = text_table(["Nd", "GB"], [[1024, "1.50"], [2, "120.00"]])
    assert table.splitlines() == ["   Nd      GB", "-----  ------", "1,024    1.50", "    2  120.00"]


def test_kib_is_one_decimal_with_separators_in_a_cell_and_with_its_unit_in_a_sentence():
    assert [kib(n) for n in (None, 0, 1536, 1e9)] == ["-", "0.0", "1.5", "976,562.5"]
    assert [kib(n, unit=True) for n in (None, 0, 1536, 1e9)] == ["-", "0.0 KiB", "1.5 KiB", "976,562.5 KiB"]


def test_trailing_space_keeps_digits_aligned_and_short_rows_are_padded():
    lines = text_table(["a", "b"], [["31.4 ", "x"], ["120.0*"]]).splitlines()
    assert lines[2] == " 31.4   x" and lines[3] == "120.0*"


def test_two_line_header_left_column_and_html():
    lines = text_table(["stage", "params\nmeasured"], [["0 DP", "535.0"]], align=["left", "right"]).splitlines()
    assert lines == ["stage    params", "       measured", "-----  --------", "0 DP      535.0"]
    html = text_table(["stage", "GB"], [["0 DP", "1.00 GB"]], fmt="html")
    assert "<td" in html and "0 DP" in html and "1.00 GB" in html


def test_rows_longer_than_the_header_and_bad_align_are_refused():
    with pytest.raises(ValueError, match="more cells"):
        text_table(["a"], [[1, 2]])
    with pytest.raises(ValueError, match="align"):
        text_table(["a", "b"], [[1, 2]], align=["left"])


def test_stage_title_is_deepspeeds_name_and_the_papers():
    assert [stage_title(s) for s in range(4)] == ["DP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)", "ZeRO-3 (P_os+g+p)"]
    with pytest.raises(ValueError):
        stage_title(4)


def _report(stage: int) -> dict:
    held = {"params": 2048, "grads": 512, "optimizer_states": 3072}
    comm = {op: {"calls": 2, "elements": 2000 if op in ("reduce_scatter", "all_gather") else 0, "bytes": 0}
            for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}
    return {"config": {"stage": stage}, "num_params": 1000, "losses": [4.0, 3.9063], "step_seconds_median": 0.0123,
            "analytic": {"model_state_bytes": held},
            "ranks": [{"rank": r, "model_state_bytes": held, "peak_bytes": None, "comm": comm} for r in range(2)]}


def test_rank_table_prints_kib_elements_and_psi_per_step():
    lines = format_rank_table(_report(2)).splitlines()
    assert lines[0].split() == ["rank", "params", "KiB", "grads", "KiB", "optim", "KiB", "all_reduce",
                                "red_scatter", "all_gather", "Psi/step", "peak", "KiB"]
    assert lines[2].split() == ["0", "2.0", "0.5", "3.0", "0", "1,000", "1,000", "2.000", "-"]
    assert lines[-1].split() == ["paper", "2.0", "0.5", "3.0", "2.000"]


def test_tour_table_prints_each_stage_measured_beside_the_formula():
    from zerolearn.report import stage_row

    lines = format_table([stage_row(_report(s)) for s in (0, 3)]).splitlines()
    assert lines[3].startswith("0 DP ") and lines[4].startswith("3 ZeRO-3 (P_os+g+p) ")
    assert lines[4].split()[3:] == ["3.906300", "2.0", "2.0", "0.5", "0.5", "3.0", "3.0", "2.000", "3.0", "12.3"]
