"""The ZeRO file to take home: ``my_zero.py``, written from the book's solutions, needs torch alone,
and under torchrun on 2 and 3 gloo ranks equals one process (rel 1e-6, fp32) at stages 0-3 with
Fig 1's bytes for fp32 Adam with an fp32 master, (4 + 4 + 12) Psi divided by Nd where the stage
partitions, for the padded Psi."""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from zerolearn.chapters.ch04 import take_home
from zerolearn.chapters.ch04.gather_hooks import gather_hooks
from zerolearn.errors import ConfigError

pytestmark = pytest.mark.slow  # the take-home script under torchrun

LAYER = 64 * 64 + 64  # one Linear(64, 64) of the script's MLP
LAYERS = 4


def expected_bytes(stage: int, nd: int) -> dict:
    """Fig 1 in fp32 with an fp32 master: one flat buffer at stages 0-2 (padded to Nd from stage
    1), one per layer at stage 3; params / grads / optimizer states divided from stage 3 / 2 / 1."""
    psi = LAYERS * LAYER
    if stage == 3:
        padded = LAYERS * (LAYER + -LAYER % nd)
    else:
        padded = psi + (-psi % nd if stage else 0)
    return {"params": 4 * padded // (nd if stage == 3 else 1), "grads": 4 * padded // (nd if stage >= 2 else 1),
            "optimizer_states": 12 * padded // (nd if stage >= 1 else 1)}


def test_the_script_imports_torch_alone(tmp_path):
    text = take_home.script()
    modules = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module.split(".")[0])
    assert modules <= {"argparse", "json", "os", "sys", "torch"}, modules
    for name in take_home.PARTS:
        assert f"def {name}(" in text, name
    assert "# PART" not in text and "BEGIN SOLUTION" not in text
    assert f"BOOK_PARTS = {list(take_home.PARTS)!r}" in text


def test_the_readers_functions_are_written_and_skeletons_left_to_the_book(tmp_path):
    path = tmp_path / "skeleton.py"
    path.write_text("def gather_hooks(unit, flat, shard, world_size):\n    raise NotImplementedError\n")
    spec = importlib.util.spec_from_file_location("skeleton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert take_home.written({"gather_hooks": module.gather_hooks}) == {}
    assert take_home.written({"gather_hooks": gather_hooks}) == {"gather_hooks": gather_hooks}
    with pytest.raises(ConfigError, match="allowed are"):
        take_home.script({"prefetch": gather_hooks})


@pytest.mark.parametrize("world_size", [2, 3])
def test_my_zero_under_torchrun_equals_one_process_with_the_formulas_bytes(world_size, tmp_path):
    take_home.write(tmp_path / "my_zero.py", book_parts=list(take_home.PARTS))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(world_size), "my_zero.py", "--stage", "0", "1", "2", "3", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3], run.stdout
    for r in rows:
        assert r["world_size"] == world_size
        assert r["rel_loss"] <= 1e-6 and r["rel_params"] <= 1e-6, r
        assert r["bytes"] == expected_bytes(r["stage"], world_size), r
        assert r["ok"] and r["wrong"] == [], r
        padding = {0: 0, 1: -LAYERS * LAYER % world_size, 2: -LAYERS * LAYER % world_size,
                   3: LAYERS * (-LAYER % world_size)}[r["stage"]]
        assert r["padding"] == padding, r


WRONG_PART = """import torch.distributed as dist


def average_gradients(model, world_size):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # the sum, never divided
"""


def test_a_wrong_part_fails_the_run_naming_every_rank_and_what_differs(tmp_path):
    (tmp_path / "wrong.py").write_text(WRONG_PART)
    spec = importlib.util.spec_from_file_location("wrong", tmp_path / "wrong.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    said = take_home.write(tmp_path / "my_zero.py", {"average_gradients": module.average_gradients},
                           book_parts=[n for n in take_home.PARTS if n != "average_gradients"])
    assert "yours average_gradients;" in said
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "my_zero.py", "--stage", "0", "1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, (run.stdout, run.stderr[-3000:])
    lines = run.stdout.splitlines()
    assert lines[0] == ("parts: yours average_gradients; the book's flatten_params, zero1_step, "
                        "reduce_scatter_hook, gather_hooks, main"), lines
    assert lines[1].startswith("DP     on 2 ranks") and "WRONG" in lines[1], lines
    for rank in (0, 1):
        assert any(line.strip().startswith(f"rank {rank}: final parameters differ from one process by rel ")
                   and "(tolerance 1e-06)" in line for line in lines[2:4]), lines
    assert lines[4].startswith("ZeRO-1 on 2 ranks") and "every rank equals one process" in lines[4], lines


def test_a_part_neither_written_nor_named_is_said_and_nothing_is_written(tmp_path):
    said = take_home.write(tmp_path / "my_zero.py", {"gather_hooks": gather_hooks}, book_parts=["zero1_step"])
    assert said.startswith("not written yet: average_gradients (exercise 01.average_gradients), flatten_params "
                           "(exercise 02.flatten_params), reduce_scatter_hook (exercise 03.reduce_scatter_hook), "
                           "main (exercise 04.main);"), said
    assert not (tmp_path / "my_zero.py").exists()
    with pytest.raises(ConfigError, match="book_parts: 'zero2_step' unknown; allowed are"):
        take_home.write(tmp_path / "my_zero.py", book_parts=["zero2_step"])


def test_the_readers_main_takes_the_templates_place_and_a_skeleton_main_is_not_written(tmp_path):
    from zerolearn import exercises

    def defined(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main

    assert take_home.written({"main": defined("skeleton", exercises.skeleton("04.main"))}) == {}
    mine = exercises.solution_source("04.main").replace("failed = False", "failed = False  # mine", 1)
    text = take_home.script({"main": defined("mine", mine)})
    assert text.count("def main(") == 1 and "failed = False  # mine" in text
    assert text.index("def main(") > text.index("def report(")  # in the template's place, after what it calls
