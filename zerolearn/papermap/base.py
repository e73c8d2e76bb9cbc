"""What every part of the paper map shares: :class:`Row`, the statuses, the model shapes
the paper uses, the chapters that show each claim, and how numbers are printed.

Units: the paper's decimal GB (1e9 bytes, ``model.GB``), parameters in billions (B),
communication in elements. Printed: GB to 1 decimal, ratios to 3 significant digits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CH", "GPT2_1_5B", "GPT_100B", "NOT_REPRODUCIBLE", "REPRODUCED", "SEQ", "SHAPE_ONLY", "STATUSES", "Row"]

REPRODUCED = "reproduced"
SHAPE_ONLY = "reproduced in shape only"
NOT_REPRODUCIBLE = "not reproducible here"
STATUSES = (REPRODUCED, SHAPE_ONLY, NOT_REPRODUCIBLE)

GPT2_1_5B = {"layers": 48, "hidden": 1600}  # the paper's GPT-2 1.5B (Sec 3)
GPT_100B = {"layers": 125, "hidden": 8192}  # a 100B GPT-like shape: 12 x 125 x 8192^2 = 100.7e9
SEQ = 1024  # the paper's sequence length, "1K" (Sec 3.2)

# Where each chapter shows a claim, and at what scale (gloo ranks on CPU unless simulated).
CH = {0: "ch. 0 on 1 rank", 1: "ch. 1 on Nd = 1, 2, 4", 2: "ch. 2 on Nd = 2, 3, 4", 3: "ch. 3 on Nd = 2, 4",
      4: "ch. 4 on 2 ranks and rank 0 of Nd = 8, 64, 1024 (simulated)", 5: "ch. 5 on Nd = 2 x Nm = 2",
      6: "ch. 6", "6sim": "ch. 6 on rank 0 of Nd = 4 to 1024 (simulated)", 7: "ch. 7 on 2 ranks"}


@dataclass(frozen=True)
class Row:
    """One claim of the paper and zerolearn's answer to it.

    ``section``: where the paper makes the claim, comma-separated references such as
    "Sec 5.1, Fig 1" or "Table 2". ``claim``: the paper's number, paraphrased.
    ``computed``: what zerolearn computes, with the numbers in ``values`` (GB,
    billions of parameters, ratios, as each key says). ``where``: the chapters that
    show or measure it and at what scale. ``status``: one of :data:`STATUSES`;
    ``why`` says what is missing when it is not :data:`REPRODUCED`.
    """

    key: str
    section: str
    claim: str
    computed: str
    where: str
    status: str
    why: str = ""
    values: dict[str, float] = field(default_factory=dict)

    def refs(self) -> tuple[str, ...]:
        """The references of ``section``, one per comma: ("Sec 5.1", "Fig 1")."""
        return tuple(part.strip() for part in self.section.split(","))
