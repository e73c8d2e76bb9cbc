"""What every part of the paper map shares: :class:`Row`, the statuses, the model shapes
the paper uses, the chapters that show each claim, and how numbers are printed.

Units: the paper's decimal GB (1e9 bytes, ``model.GB``), parameters in billions (B),
communication in elements. Printed: GB to 1 decimal, ratios to 3 significant digits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CH", "GPT2_1_5B", "GPT_100B", "NOT_REPRODUCIBLE", "REPRODUCED", "SEQ", "SHAPE_ONLY", "STATUSES", "Row",
           "Stated"]

REPRODUCED = "reproduced"
SHAPE_ONLY = "reproduced in shape only"
NOT_REPRODUCIBLE = "not reproducible here"
STATUSES = (REPRODUCED, SHAPE_ONLY, NOT_REPRODUCIBLE)

GPT2_1_5B = {"layers": 48, "hidden": 1600}  # the paper's GPT-2 1.5B (Sec 3)
# The book's shape for the paper's 100B model (Sec 3.2, 6.1): 12 x 125 x 8192^2 = 100.7e9. The paper
# lists its models' shapes in Table 4, an image in its text; these are the book's choice.
GPT_100B = {"layers": 125, "hidden": 8192}
SEQ = 1024  # the paper's sequence length, "1K" (Sec 3.2)

# Where each chapter shows a claim, and at what scale (gloo ranks on CPU unless simulated).
CH = {0: "ch. 0 on 1 rank", 1: "ch. 1 on Nd = 1, 2, 4", 2: "ch. 2 on Nd = 2, 3, 4", 3: "ch. 3 on Nd = 2, 4",
      4: "ch. 4 on 2 ranks and rank 0 of Nd = 8, 64, 1024 (simulated)", 5: "ch. 5 on Nd = 2 x Nm = 2",
      6: "ch. 6", "6sim": "ch. 6 on rank 0 of Nd = 4 to 1024 (simulated)", 7: "ch. 7 on 2 ranks"}


@dataclass(frozen=True)
class Stated:
    """A number the paper states, and how the package's computed value must stand to it.

    ``kind`` "about": |computed - value| <= ``tolerance`` x |value| (``tolerance``
    relative, 0 for exact); "below" / "above": computed < value / computed > value (the
    paper's "under 10%", "over 32 GB"). ``label`` names the quantity when the number alone
    would not say what it is."""

    value: float
    tolerance: float = 0.0
    kind: str = "about"
    label: str = ""

    def holds(self, computed: float) -> bool:
        if self.kind == "below":
            return computed < self.value
        if self.kind == "above":
            return computed > self.value
        return abs(computed - self.value) <= self.tolerance * abs(self.value)

    def text(self) -> str:
        """How the page states the test: "within 5% of 60", "P_a / MP traffic below 0.1"."""
        if self.kind in ("below", "above"):
            text = f"{self.kind} {self.value:g}"
        elif self.tolerance == 0:
            text = f"equal to {self.value:g}"
        else:
            text = f"within {100 * self.tolerance:g}% of {self.value:g}"
        return f"{self.label} {text}" if self.label else text


@dataclass(frozen=True)
class Row:
    """One claim of the paper and zerolearn's answer to it.

    ``section``: where the paper makes the claim, comma-separated references such as
    "Sec 5.1, Fig 1" or "Table 2". ``claim``: the paper's number, paraphrased.
    ``computed``: what zerolearn computes, with the numbers in ``values`` (GB,
    billions of parameters, ratios, as each key says). ``where``: the chapters that
    show or measure it and at what scale. ``status``: one of :data:`STATUSES`;
    ``why`` says what is missing when it is not :data:`REPRODUCED`.

    ``paper``: for keys of ``values``, the number the paper states (:class:`Stated`).
    ``changed``: what the book changes from the paper's stated inputs or scheme for the
    computation (a batch, a checkpointing scheme); empty when it computes at the paper's
    own inputs. ``inconsistency``: where the paper's own numbers disagree with each other.
    The status rule (``papermap.checks.paper_rule_problems``): :data:`REPRODUCED` only with
    ``paper`` numbers, nothing ``changed``, and every computed value holding its
    :class:`Stated`.
    """

    key: str
    section: str
    claim: str
    computed: str
    where: str
    status: str
    why: str = ""
    values: dict[str, float] = field(default_factory=dict)
    paper: dict[str, Stated] = field(default_factory=dict)
    changed: str = ""
    inconsistency: str = ""

    def refs(self) -> tuple[str, ...]:
        """The references of ``section``, one per comma: ("Sec 5.1", "Fig 1")."""
        return tuple(part.strip() for part in self.section.split(","))
