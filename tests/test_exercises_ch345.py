"""How the checks of chapters 3 to 5 word a wrong shard: the element named by its parameter
and position, a shard off by a known factor explained by that factor. (Every solution and
known bug of these chapters runs on real ranks in test_exercises.py.)"""

import pytest
import torch

from zerolearn.exercises.core import Wrong
from zerolearn.exercises.helpers import compare_shard, located
from zerolearn.flat import FlatLayout
from zerolearn.tables import kib

pytestmark = pytest.mark.quick

# A weight (3, 4) and a bias (4,): 16 elements, padded to 18 for 3 shards of 6; this is shard 1.
LAYOUT = FlatLayout.of(["w", "b"], [torch.Size([3, 4]), torch.Size([4])], 3, 1)


def test_a_flat_element_is_named_by_its_parameter_and_position():
    assert [located(LAYOUT, i) for i in (0, 5, 13, 17)] == ["w[0, 0]", "w[1, 1]", "b[1]", "the padding"]


def test_the_first_differing_element_of_a_shard_is_named_with_its_step():
    want = torch.zeros(6)
    got = want.clone()
    got[3] = 1.0  # flat element 6 + 3 = 9: w[2, 1]
    with pytest.raises(Wrong, match=r"your shard \(first difference at w\[2, 1\]\), element 3: you have 1") as e:
        compare_shard("your shard", got, want, LAYOUT, step=2)
    assert e.value.step == 2


def test_a_shard_off_by_a_known_factor_gets_that_factors_explanation():
    want = torch.arange(1.0, 7.0)
    with pytest.raises(Wrong, match="is 2 times the single-process training gradient: divide by world_size"):
        compare_shard("your shard", 2 * want, want, LAYOUT, 0, factors={2: "divide by world_size"})
    with pytest.raises(Wrong, match="is 1/4 of the single-process training gradient: twice"):
        compare_shard("your shard", want / 4, want, LAYOUT, 0, factors={0.25: "twice"})
    compare_shard("your shard", want.clone(), want, LAYOUT, 0, factors={2: "never said"})  # equal: no verdict


def test_bytes_read_as_kib():
    assert kib(65 * 1024, unit=True) == "65.0 KiB" and kib(1536, unit=True) == "1.5 KiB"
