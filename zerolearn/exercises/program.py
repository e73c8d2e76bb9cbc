"""Program exercises: the reader writes a whole script, and the checker runs it under torchrun.

A function exercise (:mod:`zerolearn.exercises.core`) hands the reader's function an
initialised process group. A :class:`Program` asks for the part before that: a script
that reads its place from torchrun's environment, joins the process group, calls a
collective and leaves the group. Its reference solution is a module of its chapter
(``zerolearn/chapters/ch01/allreduce.py``): a script whose ``main()`` holds the lines
between ``# BEGIN SOLUTION`` and ``# END SOLUTION``, so importing it runs nothing. The
chapter's cell is ``%%writefile <script>`` followed by that text (the reader's copy:
``main()``'s body replaced by ``raise NotImplementedError``).

:func:`zerolearn.exercises.core.check` runs the reader's file (:func:`first_mistake`) with
``python -m torch.distributed.run --standalone --nproc-per-node N`` for each N of the exercise's world sizes, each rank
through :mod:`zerolearn.exercises.program_rank` (which counts the collectives, keeps
what the rank prints and what it raised, and gives the process group a timeout), and
then the exercise's ``verdict`` reads the ranks' records. Known bugs are the solution's
text with a line or two changed (:func:`edited_text`).
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zerolearn.errors import ConfigError

RUNNER = Path(__file__).resolve().parent / "program_rank.py"
RANK_TIMEOUT_S = 20.0
"""The process-group timeout a rank's script gets when it gives none (seconds)."""

PEER_CAUSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
               "Timed out", "timed out")
"""gloo's words on a rank whose peer stopped, died or never came: not this rank's own mistake."""


@dataclass(frozen=True)
class Program:
    """A program exercise.

    ``name`` is ``"NN.script_stem"``; ``script`` the file the reader writes (``"allreduce.py"``);
    ``solution`` the module whose source is the reference script; ``verdict(records,
    world_size)`` reads one launch's rank records (rank -> the dict
    :mod:`~zerolearn.exercises.program_rank` writes) and returns the first mistake's
    ``(rank, words)`` or None; ``summary`` is what a passing check verified; ``bugs`` maps a
    bug's name to a :class:`~zerolearn.exercises.core.Bug` whose ``fn`` is the bug's
    script text; ``timeout_s`` bounds one launch (seconds).
    """

    name: str
    title: str
    script: str
    solution: object  # a module
    verdict: Callable[[dict[int, dict], int], tuple[int | None, str] | None]
    summary: str
    bugs: dict = field(default_factory=dict)
    world_sizes: tuple[int, ...] = (2, 3)
    timeout_s: float = 90.0

    @property
    def chapter(self) -> str:
        return self.name.split(".", 1)[0]

    def text(self) -> str:
        """The reference script, markers and all."""
        return Path(self.solution.__file__).read_text()


PROGRAMS: dict[str, Program] = {}


def register_program(program: Program) -> Program:
    """Add ``program`` to :data:`PROGRAMS`; raises ValueError on a repeated or malformed name."""
    if not re.fullmatch(r"\d\d\.[a-z0-9_]+", program.name):
        raise ValueError(f"program exercise name {program.name!r}: must be 'NN.script_stem'")
    if program.name in PROGRAMS:
        raise ValueError(f"program exercise {program.name!r} is registered twice")
    PROGRAMS[program.name] = program
    return program


def edited_text(text: str, replacements: dict[str, str], *, name: str) -> str:
    """A known bug as the reference script ``text`` with each ``old`` of ``replacements``
    replaced by its ``new``, in order. Raises ValueError, naming the bug, when an ``old``
    does not occur exactly once."""
    for old, new in replacements.items():
        if not old or text.count(old) != 1:
            raise ValueError(f"known bug {name}: {old!r} occurs {text.count(old) if old else 0} times in the "
                             "solution's script, not once")
        text = text.replace(old, new)
    return text


def _unmarked(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.strip() not in ("# BEGIN SOLUTION", "# END SOLUTION"))


def program_solution_cell(program: Program) -> str:
    """The book's cell: ``%%writefile`` and the reference script, markers removed."""
    return f"%%writefile {program.script}\n{_unmarked(program.text())}"


def program_skeleton_cell(program: Program) -> str:
    """The reader's cell: ``%%writefile`` and the script with ``main()``'s marked lines
    replaced by ``raise NotImplementedError``."""
    out, inside = [], False
    for line in program.text().splitlines():
        marker = line.strip()
        if marker == "# BEGIN SOLUTION":
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}# your code here", f"{indent}raise NotImplementedError"]
            inside = True
        elif marker == "# END SOLUTION":
            inside = False
        elif not inside:
            out.append(line)
    return f"%%writefile {program.script}\n" + "\n".join(out)


def unwritten(text: str) -> bool:
    """True for a script whose ``main()`` body (after its docstring) is ``raise
    NotImplementedError`` alone, as the reader's copy leaves it."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    if len(mains) != 1:
        return False
    body = mains[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def launch(script: Path, world_size: int, timeout_s: float, args: tuple[str, ...] = ()) -> tuple[dict[int, dict], str]:
    """Run ``script`` (with command line ``args``) under ``python -m torch.distributed.run
    --standalone --nproc-per-node world_size``, each rank through the rank runner: (rank ->
    record for each rank that wrote one, torchrun's last lines). A launch still running
    after ``timeout_s`` seconds is killed with its ranks."""
    with tempfile.TemporaryDirectory(prefix="zerolearn-program-") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROLEARN_PROGRAM_TIMEOUT_S": f"{RANK_TIMEOUT_S:g}"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                   str(RUNNER), out, str(script), *args]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            tail, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            tail, _ = proc.communicate()
            tail = f"(killed after {timeout_s:g} s)\n{tail}"
        records = {}
        for path in Path(out).glob("rank*.json"):
            records[int(path.stem[4:])] = json.loads(path.read_text())
    return records, "\n".join(tail.strip().splitlines()[-3:])


def script_text(program: Program, path: str | os.PathLike | None, solution: bool, bug: str | None) -> str:
    """The script to check: the reader's file ``path``, the reference (``solution``) or a known
    ``bug``'s text.

    Raises:
        ConfigError: not exactly one of ``path``, ``solution``, ``bug``; an unknown ``bug``;
            a function for ``path``; a ``path`` that is not a file (naming it and the
            working directory).
    """
    if sum([path is not None, solution, bug is not None]) != 1:
        raise ConfigError("check: give exactly one of the script's path, solution=True, bug=NAME")
    if bug is not None and bug not in program.bugs:
        raise ConfigError(f"bug {bug!r} of {program.name}: allowed are {', '.join(program.bugs) or '(none)'}")
    if path is None:
        return program.text() if solution else program.bugs[bug].fn
    if callable(path):
        raise ConfigError(f"check({program.name!r}, ...): this exercise checks a script; pass its file name, "
                          f"check({program.name!r}, {program.script!r})")
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"check({program.name!r}, {str(path)!r}): no such file in {Path.cwd()}; run the "
                          f"%%writefile {program.script} cell first")
    return path.read_text()


def first_mistake(program: Program, text: str) -> tuple[int | None, int | None, str] | None:
    """Run ``text`` as the program under torchrun on each of the exercise's world sizes in
    turn; the first mistake as (world size or None, rank or None, words), or None when every
    launch passed. A script that does not compile is named at once, without a launch."""
    try:
        compile(text, program.script, "exec")
    except SyntaxError as e:
        return None, None, f"{program.script} line {e.lineno}: SyntaxError: {e.msg}"
    with tempfile.TemporaryDirectory(prefix="zerolearn-script-") as folder:
        script = Path(folder) / program.script
        script.write_text(text)
        for world_size in program.world_sizes:
            records, tail = launch(script, world_size, program.timeout_s)
            missing = sorted(set(range(world_size)) - set(records))
            if missing:
                return world_size, missing[0], (f"the rank's process ended without finishing the script "
                                                 f"(torchrun: {tail.splitlines()[-1] if tail else 'no output'})")
            found = program.verdict(records, world_size)
            if found is not None:
                return world_size, found[0], found[1]
    return None
