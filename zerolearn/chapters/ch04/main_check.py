"""Exercise ``04.main``'s check: the take-home's program (paper Sec 5.1-5.3).

The reader writes ``main()`` of ``my_zero.py`` (:mod:`zerolearn.chapters.ch04.my_zero`):
the process group from torchrun's environment, for each stage a model, an engine made of
the book's parts and the training loop on this rank's slice, the script's self-check
(``report``), the group left, and exit status 1 when a stage was wrong. The trial writes the
script with the reader's ``main()`` and the book's other parts
(:func:`zerolearn.chapters.ch04.take_home.script`) and runs it under torchrun
(:func:`zerolearn.exercises.program.launch`): at stages 0-3 on 2 and 3 ranks every stage
must equal one process, and once more at stage 0 with a wrong part (an
``average_gradients`` that never divides) where the script must report WRONG and exit with
status 1 on every rank.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from zerolearn.chapters.ch04 import take_home
from zerolearn.chapters.ch04.my_zero import main
from zerolearn.exercises.core import Bug, Exercise, Wrong, edited, register
from zerolearn.exercises.program import PEER_CAUSED, edited_text, launch

TIMEOUT_S = 120.0
STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
_DIVIDE = "            p.grad.div_(world_size)\n"  # the book's average_gradients: the line a known bug drops


def _failed(record: dict) -> bool:
    return bool(record["error"]) and record["error"]["type"] == "SystemExit"


def _raised(records: dict[int, dict], world_size: int) -> None:
    """Raise Wrong for the first rank whose script raised (exit status aside), its own error first."""
    errors = [(r, rec["error"]) for r, rec in sorted(records.items()) if rec["error"] and not _failed(rec)]
    own = [(r, e) for r, e in errors if not any(words in e["words"] for words in PEER_CAUSED)]
    for r, e in own or errors:
        line = f" (line {e['line']} of my_zero.py: {e['text']})" if e["line"] else ""
        raise Wrong(f"on {world_size} ranks, rank {r}'s my_zero.py raised {e['type']}: {e['words']}{line}")


def _run(text: str, world_size: int, args: tuple[str, ...]) -> dict[int, dict]:
    with tempfile.TemporaryDirectory(prefix="zerolearn-my-zero-") as folder:
        path = Path(folder) / "my_zero.py"
        path.write_text(text)
        records, tail = launch(path, world_size, TIMEOUT_S, args)
    missing = sorted(set(range(world_size)) - set(records))
    if missing:
        raise Wrong(f"on {world_size} ranks, rank {missing[0]}'s process ended without finishing my_zero.py "
                    f"(torchrun: {tail.splitlines()[-1] if tail else 'no output'})")
    _raised(records, world_size)
    for r, rec in sorted(records.items()):
        if rec["open_at_end"]:
            raise Wrong(f"on {world_size} ranks, rank {r} ended with the process group still open: call "
                        "dist.destroy_process_group() before main() returns (or exits)")
    return records


def _main_trial(fn) -> str:
    """my_zero.py with ``fn`` as main(): right at stages 0-3 on 2 and 3 ranks; loud when a part is wrong."""
    text = take_home.script({"main": fn})
    for world_size in (2, 3):
        records = _run(text, world_size, ("--stage", "0", "1", "2", "3"))
        lines = records[0]["printed"]
        reported = [line for line in lines if line.split(" on ")[0].strip() in STAGES]
        if [line.split(" on ")[0].strip() for line in reported] != list(STAGES):
            raise Wrong(f"on {world_size} ranks with --stage 0 1 2 3, rank 0 printed {lines!r}: one report per "
                        "stage of parse_args().stage, in order (report(engine, losses) after each stage's steps)")
        wrong = [line.strip() for line in lines if line.startswith("    ")]
        if wrong:
            raise Wrong(f"on {world_size} ranks with the book's parts, your main() trained wrong: "
                        f"{'; '.join(wrong[:3])}")
        for r, rec in sorted(records.items()):
            if _failed(rec):
                raise Wrong(f"on {world_size} ranks rank {r} exited with status {rec['error']['words']} though every "
                            "stage equals one process: exit 1 only when report() says a stage was wrong")
    broken = edited_text(text, {_DIVIDE: ""}, name="average_gradients without its division")
    records = _run(broken, 2, ("--stage", "0"))
    quiet = [r for r, rec in sorted(records.items()) if not _failed(rec)]
    if quiet:
        raise Wrong(f"with a wrong part (average_gradients that never divides by world_size) the script reported "
                    f"{[line for line in records[0]['printed'] if 'WRONG' in line][:1]} and rank {quiet[0]} "
                    "exited with status 0: a wrong stage must exit with status 1 on every rank (sys.exit(1)), so "
                    "that torchrun and any script around it see the failure")
    return ("my_zero.py with your main() equals one process at stages 0-3 with Fig 1's bytes under torchrun on 2 "
            "and 3 ranks, and with a wrong part it exits with status 1 on every rank")


_no_destroy = edited(main, {"    dist.destroy_process_group()\n": ""}, name="_no_destroy",
                     doc="""The process group never left: torch warns at exit, and a job's ranks may hang there.""")

_exits_zero = edited(main, {"    if failed:\n        sys.exit(1)  # on every rank: torchrun reports the failure\n": ""},
                     name="_exits_zero",
                     doc="""A wrong stage printed, but the process exits 0: a job script or CI sees success.""")

_step_before_backward = edited(
    main, {"            engine.backward(loss)\n            engine.step()\n":
           "            engine.step()\n            engine.backward(loss)\n"}, name="_step_before_backward",
    doc="""The step before the backward: each step applies the previous step's gradients.""")

_two_ranks_only = edited(
    main, {"rank, world_size = dist.get_rank(), dist.get_world_size()": "rank, world_size = dist.get_rank(), 2"},
    name="_two_ranks_only", doc="""The world size written in: right on 2 ranks only.""")


register(Exercise(
    "04.main", "The take-home's program: process group, model, loop, a loud exit",
    main, _main_trial,
    {"no_destroy": Bug(_no_destroy, "torch's warning at exit", "dist.destroy_process_group()"),
     "exits_zero": Bug(_exits_zero, "a self-check that cannot fail", "exited with status 0"),
     "step_before_backward": Bug(_step_before_backward, "a loop's order", "your main() trained wrong"),
     "two_ranks_only": Bug(_two_ranks_only, "a world size written in", "on 3 ranks")},
    world_sizes=(), stepped=False))
