"""The book cites the papers for what they say.

* Sec 7.2.1 of the ZeRO paper counts the traffic of P_os+g (ZeRO-2): a reduce-scatter of
  the gradients and an all-gather of the updated parameters. For P_os alone (ZeRO-1) the
  paper states DP's volume (Sec 1, Sec 7) and ends the step with an all-gather (Sec 5.1);
  it writes out no schedule. So no line cites Sec 7.2.1 beside ZeRO-1.
* ZeRO-Infinity (arXiv 2104.07857, Sec 5.1) can offload every partitioned model state,
  parameters and gradients too, to CPU memory or NVMe: no sentence gives it the optimizer
  states on disk alone.
"""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent

SEC_721 = re.compile(r"7\.2\.1")
# ZeRO-1 by any of its names: "ZeRO-1", "stage 1" / "stages 1 and 2", or P_os not followed by "+"
# ("P_os", "$P_{os}$", "P_{\mathrm{os}}"; "P_os+g" and "$P_{os+g}$" are ZeRO-2's).
ZERO1 = re.compile(r"ZeRO-1\b|\b[Ss]tages? 1\b|P_\{?(?:\\mathrm\{)?os\}?\}?(?![\w+}]|\s*\+)")
INFINITY = re.compile(r"ZeRO-Infinity")
STATES_ON_DISK = re.compile(r"optimizer states\W+(?:\w+\W+){0,3}?(?:on|to|onto) (?:disk|NVMe)", re.I)
ALL_STATES = re.compile(r"\b(?:every|all)\b[^.;]*\bstates?\b|parameters?\b[^.]*\bgradients?\b", re.I)


def texts(*extra: str) -> list[Path]:
    """The prose the checks read: chapter sources, README, the book's pages, the package."""
    paths = sorted((ROOT / "notebooks" / "src").glob("*.py")) + [ROOT / "README.md"]
    paths += sorted((ROOT / "book").glob("*.md")) + sorted((ROOT / "zerolearn").rglob("*.py"))
    return paths + [ROOT / e for e in extra]


def zero1_cited_to_721(text: str) -> list[str]:
    """Lines of ``text`` that cite Sec 7.2.1 and name ZeRO-1 (P_os alone)."""
    return [line.strip() for line in text.splitlines() if SEC_721.search(line) and ZERO1.search(line)]


def sentences(text: str) -> list[str]:
    """``text`` with comment marks and line breaks removed, cut at each full stop."""
    flat = " ".join(re.sub(r"^\s*#+ ?", "", line) for line in text.splitlines())
    return re.split(r"(?<=[.!?])\s+(?=[A-Z*`(\[-])", flat)


def infinity_as_optimizer_states_on_disk(text: str) -> list[str]:
    """Sentences of ``text`` that give ZeRO-Infinity the optimizer states on disk (or NVMe)
    and say nothing of its other states."""
    return [s for s in sentences(text)
            if INFINITY.search(s) and STATES_ON_DISK.search(s) and not ALL_STATES.search(s)]


def test_the_detectors_see_the_wrong_wordings_and_pass_the_right_ones():
    assert zero1_cited_to_721("traffic: $2\\Psi$ per step, the same as DP (Sec 7.2.1); ZeRO-1")
    assert zero1_cited_to_721("# Stages 1 and 2 cost nothing in traffic (Sec 7.2.1).")
    assert zero1_cited_to_721("paper (Sec 7.2.1): $P_{os}$ moves 2 Psi")
    assert not zero1_cited_to_721("ZeRO-2, $P_{os+g}$, moves 2 Psi (Sec 7.2.1)")
    assert not zero1_cited_to_721("P_os+g moves 2 Psi (Sec 7.2.1)")
    assert not zero1_cited_to_721("ZeRO-1 moves DP's volume (Sec 1, Sec 7)")
    assert infinity_as_optimizer_states_on_disk("ZeRO-Infinity (optimizer states on disk) and ZeRO++.")
    assert infinity_as_optimizer_states_on_disk(
        "# ZeRO-Infinity goes one tier further and keeps the optimizer states\n# on NVMe, read before the step.")
    assert not infinity_as_optimizer_states_on_disk(
        "ZeRO-Infinity (every partitioned state in CPU memory or on NVMe; built here: the optimizer states, "
        "and at stage 3 the parameter shards, on disk).")


def test_no_line_cites_sec_7_2_1_for_zero1():
    found = {str(p.relative_to(ROOT)): hits for p in texts() if (hits := zero1_cited_to_721(p.read_text()))}
    assert not found, ("Sec 7.2.1 counts P_os+g; for P_os alone cite DP's volume (Sec 1, Sec 7) "
                       f"and the all-gather of Sec 5.1: {found}")


def test_zero_infinity_is_not_the_optimizer_states_on_disk_alone():
    found = {}
    for name in ("README.md", "notebooks/src/08_beyond.py"):
        if hits := infinity_as_optimizer_states_on_disk((ROOT / name).read_text()):
            found[name] = hits
    assert not found, ("ZeRO-Infinity offloads every partitioned model state (its Sec 5.1), not only "
                       f"the optimizer states: {found}")
