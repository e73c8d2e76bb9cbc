"""Exercise ``01.allreduce``'s check: a whole torchrun program (paper Sec 2.1, Sec 7.1).

The reader writes ``allreduce.py``: read RANK and WORLD_SIZE from torchrun's environment,
join a gloo process group, sum rank + 1 over the ranks with one ``dist.all_reduce``, print
``rank R of N: the sum is S`` and leave the group. The checker runs the file under torchrun
on 2 and 3 ranks (:func:`zerolearn.exercises.program.first_mistake`) and reads, rank by
rank, what it raised, which collectives it called, what it printed and whether it left the
group; torch's and gloo's raw words for the usual mistakes are said in the book's.
"""

from __future__ import annotations

import re
from pathlib import Path

from zerolearn.chapters.ch01 import allreduce
from zerolearn.exercises.core import Bug
from zerolearn.exercises.program import PEER_CAUSED, Program, edited_text, register_program

LINE = re.compile(r"rank (\S+) of (\S+): the sum is (\S+)")


def _said(error: dict, world_size: int, rank: int) -> str:
    """What a rank's exception means, with its line of the script."""
    words, line = error["words"], f" (line {error['line']}: {error['text']})" if error["line"] else ""
    if "has not been initialized" in words:
        return (f"a collective ran before this rank joined a process group{line}: call "
                "dist.init_process_group(\"gloo\") first")
    if "must be an integer" in words:
        return (f"init_process_group was given the rank as text{line}: environment variables are strings; "
                "int(os.environ[\"RANK\"]) and int(os.environ[\"WORLD_SIZE\"])")
    if m := re.search(r"rank < size\. (\d+) vs (\d+)", words):
        return (f"init_process_group was told world_size {m.group(2)} on rank {m.group(1)}{line}, and torchrun "
                f"started {world_size} ranks: take the world size from WORLD_SIZE in the environment")
    if "NCCL" in words or "GPU" in words:
        return (f"{error['type']}: {words}{line}: NCCL is the GPU backend; on CPUs the process group is "
                "\"gloo\"")
    if "'NoneType' object" in words:
        return (f"{error['type']}: {words}{line}: dist.all_reduce(t) returns None (a work handle with "
                "async_op=True); it sums t in place, so read t itself")
    return f"{error['type']}: {words}{line}"


def _named(calls: list[str]) -> str:
    return ", ".join(f"dist.{c}" for c in calls) if calls else "no collective"


def verdict(records: dict[int, dict], world_size: int) -> tuple[int, str] | None:
    """The first mistake of one launch, as (rank, words), or None. Order: a rank's own
    exception; ranks that called different collectives; a peer's stop seen by a rank; a
    rank that never joined a group, called anything but one all_reduce, left the group
    open, or printed a wrong line."""
    ranks = sorted(records)
    for r in ranks:
        error = records[r]["error"]
        if error and not any(words in error["words"] for words in PEER_CAUSED):
            return r, _said(error, world_size, r)
    calls = {r: [c for c in records[r]["calls"] if c != "barrier"] for r in ranks}
    for r in ranks:
        if calls[r] != calls[0]:
            return r, (f"it called {_named(calls[r])} and rank 0 called {_named(calls[0])}: "
                       "every rank calls the same collectives in the same order (a collective waits for all "
                       "its ranks)")
    for r in ranks:
        if records[r]["error"]:
            return r, _said(records[r]["error"], world_size, r)
    total = world_size * (world_size + 1) // 2
    for r in ranks:
        rec = records[r]
        if rec["backend"] is None:
            return r, "the script never called dist.init_process_group(\"gloo\"): no process group, no collective"
        if calls[r] != ["all_reduce"]:
            return r, (f"the script called {_named(calls[r])}: one dist.all_reduce(t) sums rank + 1 "
                       "over the ranks")
        if rec["open_at_end"]:
            return r, ("the process group was still open when the script ended: call dist.destroy_process_group() "
                       "last")
        found = [LINE.search(line) for line in rec["printed"]]
        found = [m for m in found if m]
        if len(found) != 1:
            return r, (f"it printed {rec['printed'][:3]!r}; each rank prints one line "
                       f"'rank {r} of {world_size}: the sum is {total}'")
        got = found[0].groups()
        if got[:2] != (str(r), str(world_size)):
            return r, (f"it printed 'rank {got[0]} of {got[1]}', and it is rank {r} of {world_size}: "
                       "RANK and WORLD_SIZE from the environment")
        if got[2] not in (str(total), f"{total}.0"):
            return r, (f"it printed the sum {got[2]}; on {world_size} ranks holding rank + 1 the sum is "
                       f"1 + ... + {world_size} = {total}")
    return None


_TEXT = Path(allreduce.__file__).read_text()
_READ_ENV = 'int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])'
_REDUCE = "    dist.all_reduce(t)  #"

BUGS = {
    "no_init": Bug(edited_text(_TEXT, {'    dist.init_process_group("gloo", rank=rank, world_size=world_size)'
                                       "  # connects to MASTER_ADDR:MASTER_PORT\n": ""}, name="no_init"),
                   "the first torch.distributed script", "before this rank joined a process group"),
    "rank_as_text": Bug(edited_text(_TEXT, {_READ_ENV: 'os.environ["RANK"], os.environ["WORLD_SIZE"]'},
                                    name="rank_as_text"),
                        "os.environ read as numbers", "environment variables are strings"),
    "two_ranks_only": Bug(edited_text(_TEXT, {_READ_ENV: 'int(os.environ["RANK"]), 2'}, name="two_ranks_only"),
                          "a world size written in the script", "torchrun started 3 ranks"),
    "result_of_all_reduce": Bug(edited_text(_TEXT, {_REDUCE: "    t = dist.all_reduce(t)  #"},
                                            name="result_of_all_reduce"),
                                "all_reduce read as a function returning the sum", "sums t in place"),
    "rank_zero_only": Bug(edited_text(_TEXT, {_REDUCE: "    if rank == 0:\n        dist.all_reduce(t)  #"},
                                      name="rank_zero_only"),
                          "a collective inside a rank's branch", "the same collectives in the same order"),
    "no_destroy": Bug(edited_text(_TEXT, {"    dist.destroy_process_group()  # leave the group before the process "
                                          "ends\n": ""}, name="no_destroy"),
                      "torch's warning at exit without destroy_process_group", "dist.destroy_process_group()"),
    "rank_not_plus_one": Bug(edited_text(_TEXT, {"float(rank + 1)": "float(rank)"}, name="rank_not_plus_one"),
                             "an off-by-one in what each rank holds", "the sum is"),
}

register_program(Program(
    "01.allreduce", "A whole program: torchrun's environment, a process group, one all-reduce",
    "allreduce.py", allreduce, verdict,
    "under torchrun on 2 and 3 ranks, every rank read its place from the environment, joined a gloo process "
    "group, called dist.all_reduce once, printed the sum (3, then 6) and left the group",
    BUGS))
