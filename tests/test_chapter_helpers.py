"""What the chapters use to show code and to train the reader's engine: ``excerpt`` (at most
15 lines read from the package's code) and ``your_engine`` (the reader's parts in NanoZero
beside one process and the package's engine)."""

import inspect

import pytest

from zerolearn.chapters.source import LIMIT, excerpt
from zerolearn.chapters.your_engine import your_engine
from zerolearn.engines.base import Engine
from zerolearn.errors import ConfigError
from zerolearn.nano import NanoZero

pytestmark = pytest.mark.slow  # the chapters' engines trained on ranks


def test_excerpt_is_the_code_without_its_docstring():
    shown = excerpt(NanoZero.zero_grad)
    source = inspect.getsource(NanoZero.zero_grad)
    assert shown.lines[0] == "def zero_grad(self) -> None:"
    assert '"""' not in shown.code
    assert all(line.strip() in source for line in shown.lines)
    assert shown.where == "zerolearn/nano.py: NanoZero.zero_grad"
    assert shown._repr_markdown_().startswith("```python\n# zerolearn/nano.py")


def test_excerpt_spans_are_joined_by_an_ellipsis_and_dedented():
    shown = excerpt(Engine._on_grad, ("def _on_grad", "def _on_grad"), ("view = ", "view.add_"))
    assert shown.lines[0].startswith("def _on_grad(")
    assert shown.lines[1] == "..."
    assert shown.lines[2].startswith("    view = b.grad_view(i)")  # dedented as a whole: the body stays indented
    assert len(shown.lines) == 4


def test_excerpt_refuses_more_than_the_limit_and_unknown_lines():
    with pytest.raises(ValueError, match=rf"more than {LIMIT}"):
        excerpt(Engine.__init__)
    with pytest.raises(ValueError, match="no line contains 'not in the code'"):
        excerpt(Engine._on_grad, ("not in the code", "x"))


def stub_zero1_step(flat_params, flat_grad, state, world_size, rank, lr, *, reduced=False, gather=True):
    raise NotImplementedError


def test_your_engine_trains_as_one_process_with_fig1_bytes():
    trained = your_engine(2, {})
    for name in ("your engine", "package engine"):
        assert trained.max_rel_diff(name) < 1e-6
        row = trained.rows[name]
        formula = trained.formula(name)
        assert sum(row["bytes"].values()) == formula["total"]
        assert row["moved"] == 2 * (trained.psi + row["padding"])
    assert "your engine" in str(trained) and trained.missing is None
    # the footnote's bytes per parameter are this stage's (ZeRO-2 on 2 ranks), and each is Fig 1's total over Psi
    assert "yours 4 + 4 / 2 + 12 / 2 = 12, the package's 4 + 4 / 2 + 8 / 2 = 10" in str(trained), str(trained)
    for name, k in (("your engine", 12), ("package engine", 8)):
        per = float(trained.per_parameter(k).rsplit("= ", 1)[1])
        assert per == pytest.approx(trained.formula(name)["total"] / (trained.psi + trained.rows[name]["padding"]))


def test_your_engine_names_a_part_not_written_yet():
    trained = your_engine(1, {"zero1_step": stub_zero1_step})
    assert trained.missing == "stub_zero1_step"
    assert "your engine" not in trained.rows
    assert "stub_zero1_step still raises NotImplementedError" in str(trained)


def test_your_engine_refuses_a_bad_part_before_starting_ranks():
    with pytest.raises(ConfigError, match="'zero4_step'"):
        your_engine(1, {"zero4_step": print})
