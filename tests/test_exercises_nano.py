"""The exercises of issue 36 in the reader's hands: functions defined in a cell, as a notebook
defines them. (Every solution and known bug runs in test_exercises.py.)"""

import pytest

from zerolearn import exercises
from zerolearn.exercises import EXERCISES, check

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module", autouse=True)
def persistent_ranks():
    with exercises.reusing_ranks():
        yield


def _cell(name: str, source: str):
    namespace = {"__name__": "__main__"}
    exec(compile(exercises.PRELUDE + "\n" + source, "<cell>", "exec"), namespace)
    return namespace[EXERCISES[name].solution.__name__]


READS_FREED = '''
def prefetch(units, flats, shards, world_size):
    def before(i):
        flats[i].untyped_storage().resize_(flats[i].numel() * flats[i].element_size())
        dist.all_gather_single(flats[i], shards[i])
        flats[(i + 1) % len(units)].view(-1)[0].item()  # reads the next unit, still freed
    for i, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda m, a, i=i: before(i))
        unit.register_forward_hook(lambda m, a, o, i=i: flats[i].untyped_storage().resize_(0))
'''


def test_prefetch_names_the_readers_line_not_torchs_error():
    result = check("04.prefetch", _cell("04.prefetch", READS_FREED), quiet=True)
    assert not result.passed
    text = str(result)
    assert "the forward read the parameters of a unit whose buffer held no data" in text, text
    assert "units [1, 2, 3] held 0 bytes" in text, text
    assert "setStorage" not in text and "not allocated yet" not in text


A_READERS_ENGINE = '''
from zerolearn.chapters.ch02.shard_range import shard_range as book_shard_range
from zerolearn.nano import NanoZero

def shard_range(psi, world_size, rank):
    shard = -(-psi // world_size)
    return rank * shard, (rank + 1) * shard, shard * world_size - psi

def nano_engine(model, stage, lr):
    return NanoZero(model, stage, lr, parts={"shard_range": shard_range})
'''


def test_nano_engine_runs_the_readers_parts_own_checks():
    result = check("04.nano_engine", _cell("04.nano_engine", A_READERS_ENGINE), quiet=True)
    assert result.passed, str(result)
    assert "your parts pass their own checks (02.shard_range)" in str(result)


PREFETCH_WITHOUT_THE_FLAG = '''
from zerolearn.chapters.ch04.prefetch import prefetch as book_prefetch
from zerolearn.nano import NanoZero

def prefetch(units, flats, shards, world_size):  # the reader's own, written in a cell
    return book_prefetch(units, flats, shards, world_size)

def nano_engine(model, stage, lr):
    return NanoZero(model, stage, lr, parts={"prefetch": prefetch})
'''


@pytest.mark.slow  # a check on fresh ranks
def test_a_part_the_engine_never_runs_is_refused():
    result = check("04.nano_engine", _cell("04.nano_engine", PREFETCH_WITHOUT_THE_FLAG), quiet=True)
    assert not result.passed
    assert "your prefetch never runs; pass prefetch=True" in str(result), str(result)
