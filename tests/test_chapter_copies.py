"""Code a chapter writes in its cells and keeps, for a later chapter, in its lesson module
too stays the same code: chapter 2 writes the whole-tensor owner splits and ``NaiveZero1``
in its cells (notebooks/src/02_zero1.py), and chapter 3 subclasses the copies in
``zerolearn.chapters.ch02.lesson``. The tests run both copies on the same inputs and
compare what they return and train, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from jobs import on_ranks
from zerolearn import comm
from zerolearn.chapters.ch02 import lesson as ch02
from zerolearn.exercises.helpers import GPT
from zerolearn.models import build_model

pytestmark = pytest.mark.quick

SOURCE = Path(__file__).resolve().parent.parent / "notebooks" / "src" / "02_zero1.py"


def chapter_cell(starts: str) -> str:
    """The code cell of chapter 2's source that begins with ``starts``."""
    cells = [c.split("\n", 1)[1] if "\n" in c else "" for c in SOURCE.read_text().split("# %%")]
    found = [c for c in cells if c.lstrip().startswith(starts)]
    assert len(found) == 1, f"chapter 2 has {len(found)} cells starting with {starts!r}"
    return found[0]


def chapter_namespace() -> dict:
    """The chapter's owner splits and NaiveZero1, defined from its cells."""
    namespace = {"torch": torch, "dist": dist, "comm": comm}
    exec(chapter_cell("def owners_by_count"), namespace)  # noqa: S102 - the chapter's own code
    exec(chapter_cell("class NaiveZero1"), namespace)  # noqa: S102
    return namespace


@pytest.mark.parametrize("sizes, nd", [([5, 3, 8, 1, 1], 2), ([128] * 7 + [65536, 4096], 3), ([1], 4),
                                        ([7, 7, 7], 3), (list(range(1, 30)), 4)])
def test_the_owner_splits_agree(sizes, nd):
    chapter = chapter_namespace()
    for policy in ("count", "size"):
        assert chapter["OWNERS"][policy](sizes, nd) == ch02.OWNERS[policy](sizes, nd), (policy, sizes, nd)


def _train_both(steps: int) -> dict:
    """On every rank: the chapter's NaiveZero1 and the lesson's, each on its own copy of the
    book's GPT, the same batches, ``steps`` steps; the parameters each ends with."""
    chapter = chapter_namespace()
    out = {}
    for name, cls in (("chapter", chapter["NaiveZero1"]), ("lesson", ch02.NaiveZero1)):
        for owners in ("count", "size"):
            model = build_model("gpt", 0, gpt=GPT)
            opt = cls(model, lr=1e-2, owners=owners)
            for step in range(steps):
                gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
                x = torch.randint(0, 256, (2, GPT.seq_len), generator=gen)
                model(x).float().square().mean().backward()
                opt.step()
                model.zero_grad()
            out[name, owners] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.slow  # three stages trained twice
def test_naive_zero1_written_in_chapter_2_trains_as_the_lessons_copy():
    results = on_ranks(_train_both, 2, 3)
    assert len(results) == 2
    for result in results:
        for owners in ("count", "size"):
            chapter, lesson = result["chapter", owners], result["lesson", owners]
            assert len(chapter) == len(lesson) > 0, owners
            torch.testing.assert_close(chapter, lesson, rtol=0, atol=0, msg=owners)
