"""The one checker behind every build-it exercise: a registry, :func:`check`, and the
helpers a check uses to report the first wrong thing in the reader's terms.

An :class:`Exercise` is a function the reader writes with a stated signature. Its
reference solution lives with its chapter (``zerolearn/chapters/chNN/<function>.py``,
its trial and known bugs beside it in ``<function>_check.py``) and is the one source of
the book's solution cell and of the reader's skeleton: the lines between ``# BEGIN
SOLUTION`` and ``# END SOLUTION`` in the solution's body are what the reader writes
(:func:`skeleton` replaces them with ``raise NotImplementedError``).

A check runs the exercise's ``trial`` with the reader's function, on 2 and then 3
real gloo ranks (uneven shards included) for rank exercises, or once in this process
for the formula exercises of chapters 00, 06 and 07. A trial compares against
single-process training and the communication and memory ledgers and raises
:class:`Wrong` at the first difference, naming the step and the element; the rank is
added here. Every exercise also ships the known bugs of its kind (:class:`Bug`), each
with the words its message must contain, so tests prove the checker catches them; most
are the solution with a line or two changed (:func:`edited`).

A mistake may live on one rank only. The ranks then agree on the verdict: at the end of
each step a trial calls :func:`agree`, which exchanges pass or fail on the process
group's key-value store (no collective, so nothing there can hang), and a rank that
failed posts it at once; every rank stops together. Collectives are checked for
agreement before they run (:func:`zerolearn.comm.set_debug`). A rank left waiting in a
collective for a peer that stopped cannot be woken: the kernel side reports the first
real verdict of any rank (its rank, step and words) as soon as it arrives and replaces
the ranks still waiting (:meth:`zerolearn.live.Ranks.call_until`), so a check answers
within seconds whichever rank is wrong.

Solutions and reader functions may use, besides their arguments, the names
``torch``, ``nn``, ``F`` and ``dist`` (:data:`PRELUDE`), which each chapter imports
before its exercises; they call torch.distributed's collectives by torch's names, and
the trial books them (:func:`zerolearn.watch.watching`: calls, elements and bytes in
:data:`zerolearn.comm.LEDGER`). A function that calls :mod:`zerolearn.comm`'s wrappers
instead is booked the same, once.
"""

from __future__ import annotations
import __future__  # the module too: its features' compiler flags, for edited()

import ast
import contextlib
import inspect
import linecache
import re
import sys
import sysconfig
import textwrap
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerolearn.errors import ConfigError
from zerolearn.exercises.pending import ReadBeforeWait, pending_reads
from zerolearn.exercises.program import (
    PROGRAMS,
    first_mistake,
    program_skeleton_cell,
    program_solution_cell,
    script_text,
    unwritten,
)
from zerolearn.watch import watching

__all__ = ["EXERCISES", "PRELUDE", "Bug", "Exercise", "Mistake", "Result", "Wrong", "agree", "check",
           "close_ranks", "defined_at", "edited", "first_difference", "machinery", "readers_line", "register",
           "reusing_ranks", "skeleton", "solution_source", "unchanged"]

PRELUDE = "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\nfrom torch import nn"
"""The imports every exercise function may rely on (a chapter runs them before its exercises)."""

class Wrong(Exception):  # noqa: N818 - reads as a verdict: raise Wrong("...")
    """Raised by a trial at the first wrong thing it sees; ``step`` (0-based) when it is in a step."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Bug:
    """A known bug of an exercise's kind: a wrong implementation ``fn``, where it is
    seen (``source``), and words its check's message must contain (``says``). ``fn`` is
    the reference solution with a line or two changed (:func:`edited`) where the bug is
    a near-copy of it, and a function of its own otherwise."""

    fn: Callable
    source: str
    says: str


def edited(solution: Callable, replacements: dict[str, str], *, name: str, doc: str | None = None,
           names: dict[str, Any] | None = None) -> Callable:
    """A known bug written as a small edit of the reference ``solution``: its source
    (:func:`inspect.getsource`, markers and all) with each ``old`` text of
    ``replacements`` replaced by its ``new`` text, in order, and the function renamed
    ``name``. Built at import time, so that a change to a solution that a bug's edit no
    longer fits fails at once; where a bug is not a near-copy of its solution, it stays a
    hand-written function.

    The new function is compiled in ``solution``'s module globals (a copy of them with
    ``names`` added, the check module's helpers a bug needs, when given), with the
    solution's ``from __future__`` flags; it takes the solution's signature, and ``doc``
    (what the bug gets wrong) as its docstring. It belongs to the calling module, as
    ``<module>.<name>``: the check module must bind it there under ``name``
    (``_always_pad = edited(shard_range, {...}, name="_always_pad")``), so that it is
    sent to rank processes by reference, like a hand-written bug (:func:`register`
    checks this). Its line numbers are the solution file's (shifted by any lines an
    edit adds or removes) and its edited source is put in :mod:`linecache` under a
    file name of its own beside the solution's, so a traceback and the checker's
    verdict show the edited line, and :func:`inspect.getsource` the edited function.
    ``fn.edited_from`` is the solution, ``fn.edits`` the replacements.

    Raises:
        ValueError: an ``old`` text that does not occur exactly once in the source (at
            its turn; naming the bug, the text and how often it occurs), an empty
            ``old`` text, or an edited source that does not compile (naming the bug).
    """
    caller = inspect.currentframe().f_back.f_globals["__name__"]
    where = f"known bug {caller}.{name}"
    lines, first = inspect.getsourcelines(solution)
    source = "".join(lines)
    for old, new in replacements.items():
        if not old:
            raise ValueError(f"{where}: an empty text to replace")
        found = source.count(old)
        if found != 1:
            raise ValueError(f"{where}: the text {old!r} occurs {found} times in the source of "
                             f"{solution.__module__}.{solution.__qualname__}; an edit must match exactly once")
        source = source.replace(old, new)
    source, renamed = re.subn(rf"^(\s*(?:async\s+)?def\s+){re.escape(solution.__name__)}\b", rf"\g<1>{name}",
                              source, count=1, flags=re.MULTILINE)
    if not renamed:
        raise ValueError(f"{where}: no 'def {solution.__name__}' left in the edited source")
    filename = f"{inspect.getsourcefile(solution)} (edited: {caller}.{name})"
    padded = "\n" * (first - 1) + source  # line N is line N of the solution's file
    flags = sum(feature.compiler_flag for feature in (getattr(__future__, f) for f in __future__.all_feature_names)
                if solution.__code__.co_flags & feature.compiler_flag)
    try:
        code = compile(padded, filename, "exec", flags=flags, dont_inherit=True)
    except SyntaxError as e:
        raise ValueError(f"{where}: the edited source of {solution.__qualname__} does not compile: {e}") from e
    linecache.cache[filename] = (len(padded), None, padded.splitlines(True), filename)
    namespace = solution.__globals__ if names is None else {**solution.__globals__, **names}
    defined: dict[str, Any] = {}
    exec(code, namespace, defined)  # noqa: S102 - the solution's own source, edited
    fn = defined[name]
    fn.__module__, fn.__qualname__ = caller, name
    if doc is not None:
        fn.__doc__ = doc
    fn.edited_from, fn.edits = solution, dict(replacements)
    return fn


@dataclass(frozen=True)
class Exercise:
    """One build-it exercise.

    ``name`` is ``"NN.function_name"`` (chapter first); ``solution`` is the reference
    function (its ``__name__`` is the function the reader writes); ``trial(fn)`` runs
    on every rank (``world_sizes``; empty for an in-process exercise), raises
    :class:`Wrong` at the first mistake and otherwise returns a one-line summary of
    what it verified (the same on every rank); ``bugs`` maps a bug's name to :class:`Bug`;
    ``stepped`` says that the trial trains in steps and calls :func:`agree` after each, so
    that an exception is reported with the step it was raised in; ``async_reads`` runs the
    trial under :func:`zerolearn.exercises.pending.pending_reads`, which names an async
    collective's output used before its handle's ``wait()``.
    """

    name: str
    title: str
    solution: Callable
    trial: Callable[[Callable], str]
    bugs: dict[str, Bug] = field(default_factory=dict)
    world_sizes: tuple[int, ...] = (2, 3)
    timeout_s: float = 120.0
    stepped: bool = True  # the trial trains in steps and calls agree(step) after each
    async_reads: bool = False  # the trial names an async collective's output used before its wait()

    @property
    def chapter(self) -> str:
        return self.name.split(".", 1)[0]


EXERCISES: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    """Add ``exercise`` to :data:`EXERCISES`; raises ValueError on a repeated or malformed name, a
    ``timeout_s`` outside (0, 300] seconds, or on a bug built by :func:`edited` that its module
    does not bind under its name (it could not be sent to the ranks by reference)."""
    if not re.fullmatch(r"\d\d\.[a-z0-9_]+", exercise.name):
        raise ValueError(f"exercise name {exercise.name!r}: must be 'NN.function_name'")
    if exercise.name in EXERCISES:
        raise ValueError(f"exercise {exercise.name!r} is registered twice")
    if not 0 < exercise.timeout_s <= _LONGEST_S:
        raise ValueError(f"exercise {exercise.name!r}: timeout_s {exercise.timeout_s} must be in (0, {_LONGEST_S:g}] "
                         "seconds, the kept ranks' own limit")
    for bug_name, bug in exercise.bugs.items():
        fn = bug.fn
        if hasattr(fn, "edited_from") and getattr(sys.modules.get(fn.__module__), fn.__qualname__, None) is not fn:
            raise ValueError(f"{exercise.name}: bug {bug_name!r} was built by edited(name={fn.__qualname__!r}); "
                             f"bind it in {fn.__module__} as {fn.__qualname__} = edited(...)")
    EXERCISES[exercise.name] = exercise
    return exercise


def get(name: str):
    """The exercise called ``name``: an :class:`Exercise`, or a program exercise
    (:class:`zerolearn.exercises.program.Program`); raises ConfigError listing the names when
    there is none."""
    if name in PROGRAMS:
        return PROGRAMS[name]
    if name not in EXERCISES:
        raise ConfigError(f"exercise {name!r}: allowed are {', '.join(sorted([*EXERCISES, *PROGRAMS]))}")
    return EXERCISES[name]


# ----- the reader's copy ---------------------------------------------------------------

def solution_source(name: str) -> str:
    """The reference solution's source, markers removed (what the book shows folded); for a
    program exercise, the ``%%writefile`` cell of its whole script."""
    if name in PROGRAMS:
        return program_solution_cell(PROGRAMS[name])
    src = textwrap.dedent(inspect.getsource(get(name).solution))
    return "\n".join(line for line in src.splitlines() if line.strip() not in ("# BEGIN SOLUTION", "# END SOLUTION"))


def skeleton(name: str) -> str:
    """The solution with the lines between its markers replaced by ``raise NotImplementedError``:
    the signature and docstring the reader fills in; for a program exercise, the
    ``%%writefile`` cell of its script with ``main()``'s body left to write."""
    if name in PROGRAMS:
        return program_skeleton_cell(PROGRAMS[name])
    src = textwrap.dedent(inspect.getsource(get(name).solution))
    out, inside = [], False
    for line in src.splitlines():
        marker = line.strip()
        if marker == "# BEGIN SOLUTION":
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# your code here")
            out.append(f"{indent}raise NotImplementedError")
            inside = True
        elif marker == "# END SOLUTION":
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{name}: '# BEGIN SOLUTION' without '# END SOLUTION'")
    return "\n".join(out)


# ----- comparing -----------------------------------------------------------------------

def first_difference(what: str, got: torch.Tensor, want: torch.Tensor, *, step: int | None = None,
                     rtol: float = 1e-5, atol: float = 1e-6, reference: str = "single-process training") -> None:
    """Raise :class:`Wrong` naming the first element of ``got`` that differs from ``want``.

    Shapes are compared first ("``what`` has shape (3,), expected (4,)"); then values,
    elementwise with ``torch.isclose(rtol, atol)`` after flattening, and the message
    names the flat index and both values, ``reference`` saying where the expected
    value comes from.
    """
    if not isinstance(got, torch.Tensor):
        raise Wrong(f"{what} is a {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}", step)
    if got.shape != want.shape:
        raise Wrong(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}", step)
    g, w = got.detach().flatten().double(), want.detach().flatten().double()
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise Wrong(f"{what}, element {i}: you have {g[i].item():.6g}, {reference} gives "
                    f"{w[i].item():.6g} ({int(bad.sum())} of {g.numel()} elements differ)", step)


def unchanged(what: str, got: torch.Tensor, before: torch.Tensor, name: str, *, step: int | None = None) -> None:
    """Raise :class:`Wrong` when ``got`` equals ``before`` bit for bit, where the reader's function
    had to write into the caller's tensor ``name`` (the check knows the write changes it): a new
    tensor bound to the parameter's name is the usual cause, and the message says so."""
    if got.shape == before.shape and torch.equal(got, before):
        raise Wrong(f"{what} is exactly as it was before your function ran: nothing was written into it. "
                    f"`{name} = ...` inside your function binds the name to a new tensor and leaves the caller's "
                    f"tensor as it was; write into it in place ({name}.copy_(...), out={name}, or {name} as a "
                    "collective's output)", step)


# ----- running a check -----------------------------------------------------------------

@dataclass(frozen=True)
class Mistake:
    """The first wrong thing a check found: on ``rank`` (None in process), at ``step``."""

    rank: int | None
    step: int | None
    message: str

    def __str__(self) -> str:
        where = [f"rank {self.rank}"] if self.rank is not None else []
        where += [f"step {self.step}"] if self.step is not None else []
        return f"{', '.join(where)}: {self.message}" if where else self.message


@dataclass(frozen=True)
class Result:
    """What :func:`check` found: ``passed``, the ``mistake`` if not, what was verified."""

    name: str
    passed: bool
    written: bool = True
    mistake: Mistake | None = None
    world_size: int | None = None
    summary: str = ""

    shown: bool = field(default=False, compare=False, repr=False)  # check() printed it already

    def __bool__(self) -> bool:
        return self.passed

    def _ipython_display_(self) -> None:
        # A notebook cell ending in check(...) shows the verdict once: check printed it.
        if not self.shown:
            print(self)

    def __str__(self) -> str:
        if not self.written:
            return f"{self.name}: not written yet (the function still raises NotImplementedError)."
        if self.passed:
            return f"{self.name}: correct. {self.summary}"
        on = f" on {self.world_size} ranks" if self.world_size else ""
        return f"{self.name}: wrong{on}. {self.mistake}"


_PACKAGE = Path(__file__).resolve().parent.parent  # zerolearn/
_SOLUTIONS = (Path(__file__).resolve().parent, _PACKAGE / "chapters")  # the checker; solutions, trials, bugs
_MACHINERY = ("core.py", "__main__.py", "__init__.py", "helpers.py", "lesson.py", "pending.py",
              "timing.py")  # in _SOLUTIONS, at any depth


_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_SPANS: set[tuple[Path, int, int]] = set()  # (file, first line, last line) of functions marked by machinery()


def machinery(fn: Callable) -> Callable:
    """Mark ``fn``, a function of a trial (a wrapper it puts around a collective, say), as the
    checker's machinery: :func:`_reader_frames` then skips its frames, so an error raised
    through it is named at the reader's line that called it. Returns ``fn``."""
    code = fn.__code__
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    _SPANS.add((Path(code.co_filename).resolve(), code.co_firstlineno, last))
    return fn


def _marked(path: Path, lineno: int | None) -> bool:
    return lineno is not None and any(path == f and first <= lineno <= last for f, first, last in _SPANS)


def _reader_frames(tb: traceback.StackSummary) -> str:
    """The last frame of the reader's (or a solution's) code in a traceback, as ' (line N: code)':
    frames in torch and other installed packages, in Python's standard library (contextlib's
    ``self.gen.throw``, say), in the package's machinery (here: the checker, the trials'
    shared helpers and the chapters' lessons, :data:`_MACHINERY`) and in functions of a
    trial marked with :func:`machinery` are skipped; the chapters' exercise and check
    modules count, so a raising solution or known bug is named at its own line, and an
    error in a helper at the trial's line that called it."""
    def theirs(frame) -> bool:
        if frame.filename == _BY_VALUE:
            return True  # the reader's function, sent to the rank by value: its line is named on the kernel side
        if frame.filename.startswith("<") and not frame.filename.startswith("<cell"):
            return False  # <frozen ...>, <string>: Python's own
        path = Path(frame.filename).resolve()
        if _marked(path, frame.lineno):
            return False
        if any(path.is_relative_to(folder) for folder in _SOLUTIONS):
            return path.name not in _MACHINERY
        return not (path.is_relative_to(_PACKAGE) or path.is_relative_to(_STDLIB) or "site-packages" in path.parts
                    or "dist-packages" in path.parts)

    frame = ([f for f in tb if theirs(f)] or list(tb))[-1]
    return f" (line {frame.lineno}: {frame.line})" if frame.line else f" (line {frame.lineno} of {frame.name})"


def _in_a_trial(tb: traceback.StackSummary) -> bool:
    """Whether the innermost frame of a solution's or check's module in ``tb`` is a check's
    (``*_check.py``): the trial itself, not the reader's function, was running."""
    mine = [f for f in tb if not f.filename.startswith("<") and any(
        Path(f.filename).resolve().is_relative_to(folder) for folder in _SOLUTIONS)
        and Path(f.filename).name not in _MACHINERY]
    return bool(mine) and mine[-1].filename.endswith("_check.py") and not any(
        f.filename == _BY_VALUE or f.filename.startswith("<cell") for f in tb)


_BY_VALUE = "<dynamic-code>"  # cloudpickle's file name for the code of a function it sends by value
_UNSOURCED = re.compile(r" \(line (\d+) of ([A-Za-z_][A-Za-z0-9_]*)\)")


def defined_at(fn: Callable) -> str:
    """Where function ``fn`` is defined, as ' (line N: def ...)'; ' (line N of NAME)' for a function
    sent to this rank by value, whose source only the kernel side has (:func:`check` fills it in);
    '' for an object without code."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    text = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f" (line {code.co_firstlineno}: {text})" if text else f" (line {code.co_firstlineno} of {code.co_name})"


def _codes(fn: Callable):
    """The code objects of ``fn`` and of the functions defined inside it, at any depth."""
    todo = [getattr(fn, "__code__", None)]
    while todo:
        code = todo.pop()
        if code is not None:
            yield code
            todo += [c for c in code.co_consts if inspect.iscode(c)]


def _sourced(message: str, fn: Callable) -> str:
    """``message`` with each ' (line N of NAME)' a rank wrote for the reader's function, whose source
    a rank does not have (cloudpickle sent it by value), made ' (line N: code)' from the source
    this process has; left as it is where that source is not found."""
    def line(match: re.Match) -> str:
        lineno, name = int(match.group(1)), match.group(2)
        for code in _codes(fn):
            if code.co_name == name and code.co_firstlineno <= lineno:
                text = linecache.getline(code.co_filename, lineno).strip()
                if text:
                    return f" (line {lineno}: {text})"
        return match.group(0)

    return _UNSOURCED.sub(line, message)


def readers_line() -> str:
    """Where the reader's code is now, as ' (line N: code)': the last frame of the reader's
    function on the current stack (see :func:`_reader_frames`); for a trial's check that runs
    inside a call the reader made (a collective it called, say)."""
    return _reader_frames(traceback.extract_stack()[:-1])


# torch's words for a tensor read while its storage holds 0 bytes (freed by resize_(0), or never allocated)
_FREED = ("data is not allocated yet", "for storage of size 0")


# gloo's and torch's words for a collective or a storage that does not fit, and what the reader did
_GLOO_TYPE = re.compile(r"ProcessGroupGloo::(\w+): invalid tensor type at index \d+ \(expected "
                        r"TensorOptions\(dtype=([\w:]+),.*got TensorOptions\(dtype=([\w:]+),", re.S)
_GLOO_SIZE = re.compile(r"ProcessGroupGloo::(\w+): invalid tensor size at index \d+ \(expected \((\d+)\), "
                        r"got \((\d+)\)\)")
_GLOO_RS_TYPE = re.compile(r"Check failed: outputTensors\[i\]\.dtype\(\) == inputTensors\[i\]\.dtype\(\) "
                           r"\(([\w:]+) vs\. ([\w:]+)\)")
_GLOO_RS_SIZE = re.compile(r"Check failed: outputShape\[0\] \* worldSize == inputShape\[0\] \((\d+) vs\. (\d+)\)")
_SET_STORAGE = re.compile(r"setStorage: .*itemsize (\d+) requiring a storage size of (\d+) are out of bounds for "
                          r"storage of size (\d+)")


def _dtype(name: str) -> str:
    """torch's C++ name of a dtype (``float``, ``c10::BFloat16``) as Python writes it."""
    name = name.replace("c10::", "")
    return {"float": "float32", "double": "float64", "BFloat16": "bfloat16", "Half": "float16"}.get(name, name)


def _translated(words: str) -> str | None:
    """What gloo's or torch's raw words for a collective or storage that does not fit mean, and
    the fix; None for other words."""
    if m := _GLOO_TYPE.search(words):
        return (f"the {m.group(1).replace('allgather', 'all-gather')}'s output and input must have one dtype: the "
                f"input is {_dtype(m.group(2))}, the output {_dtype(m.group(3))}; gather into a buffer of the "
                "input's dtype, or cast the input first (.to(output.dtype))")
    if m := _GLOO_SIZE.search(words):
        op = m.group(1).replace("allgather", "all-gather")
        return (f"the {op}'s output must hold world_size x the input's elements, {m.group(2)}, and it holds "
                f"{m.group(3)}: every rank's shard has the same size (padded), and the output is the whole padded "
                "buffer")
    if m := _GLOO_RS_TYPE.search(words):
        return (f"the reduce-scatter's output and input must have one dtype: the output is {_dtype(m.group(1))}, "
                f"the input {_dtype(m.group(2))}; reduce into a shard of the input's dtype")
    if m := _GLOO_RS_SIZE.search(words):
        return (f"the reduce-scatter's input must hold world_size x the output's elements: world_size x the "
                f"output's is {m.group(1)}, the input holds {m.group(2)}; the output is one padded shard, the input "
                "the whole padded buffer")
    if m := _SET_STORAGE.search(words):
        need, have = int(m.group(2)), int(m.group(3))
        return (f"a tensor needs {need:,} bytes of its storage and the storage holds {have:,}: "
                "untyped_storage().resize_(n) takes n in bytes, numel() * element_size() for the whole tensor "
                "(numel() alone counts elements)")
    return None


def _raised(e: Exception) -> str:
    """The verdict for an exception the reader's function raised: its type, its words and the
    reader's line; torch's words for a tensor whose storage was freed, and gloo's and torch's
    raw words for a collective or a storage that does not fit, are said in the book's."""
    where = _reader_frames(traceback.extract_tb(e.__traceback__))
    words = str(e)
    if isinstance(e, RuntimeError) and any(freed in words for freed in _FREED):
        torch_says = words.strip().split("\n", 1)[0].split(". ", 1)[0]
        return (f"your function raised {type(e).__name__}{where}: a tensor was read while its storage held 0 "
                "bytes, freed (untyped_storage().resize_(0)) or never allocated; grow the storage back (or keep "
                f"a tensor that owns its memory) before reading it (torch: {torch_says})")
    if isinstance(e, ReadBeforeWait):
        if _in_a_trial(traceback.extract_tb(e.__traceback__)):
            return (f"{words}. Your function returned with it still in flight, and the check's next use of the "
                    "tensor came before any wait: wait for the handle before your function returns")
        return f"{words}. The use{where}"
    if isinstance(e, RuntimeError) and (meaning := _translated(words)):
        return f"your function raised {type(e).__name__}{where}: {meaning}"
    if isinstance(e, UnboundLocalError) and (m := re.search(r"local variable '(\w+)'", words)):
        name = m.group(1)
        return (f"your function raised UnboundLocalError: {words}{where}: an assignment `{name} = ...` anywhere in "
                f"a function makes {name} a new local name there, hiding the {name} it was given; to update that "
                f"tensor write into it in place ({name}.copy_(...), {name}.div_(...), out={name})")
    return f"your function raised {type(e).__name__}: {words}{where}"


# ----- ranks agree on the verdict --------------------------------------------------------

AGREE_S = 8.0
"""Seconds a rank that finished a trial step waits at :func:`agree` for its peers to finish it
too. Steps take milliseconds; a peer still missing after this waits in a collective that
this rank never called."""
_POLL_S = 0.002


class _PeerFailed(Exception):  # noqa: N818 - raised on a rank whose peer failed first
    def __init__(self, rank: int):
        super().__init__(rank)
        self.rank = rank


@dataclass
class _Agreement:
    """One trial's side channel on a rank: the process group's key-value store, under ``token``."""

    store: Any
    token: str
    rank: int
    world_size: int
    step: int = 0  # steps every rank has finished
    first: int = 0  # collectives this rank had issued through comm before the trial

    def key(self, what: str) -> str:
        return f"zerolearn/check/{self.token}/{what}"

    def fail(self) -> None:
        """Post that this rank failed (the first rank to post is kept), so that peers stop at their next step."""
        try:
            self.store.compare_set(self.key("failed"), "", str(self.rank))
        except Exception:  # noqa: BLE001 - the store is gone with a killed peer: nobody to tell
            pass

    def failed(self) -> int | None:
        if self.store.check([self.key("failed")]):
            return int(self.store.get(self.key("failed")))
        return None


_AGREEMENT: _Agreement | None = None  # set on each rank while a trial runs


def agree(step: int, point: str | None = None) -> None:
    """The end of a trial's ``step`` on this rank: post that this rank passed it and wait until
    every peer has passed it too, at most :data:`AGREE_S` seconds, on the process group's
    key-value store (which no collective can block).

    A trial calls it after each step's comparisons, so that ranks stop together: when a peer
    posted a failure instead, this rank stops here (and does not enter the next step's
    collectives, where it would wait for the failed rank forever). A peer that does not
    arrive in time is named in a :class:`Wrong`. Outside a check on ranks it does nothing.

    With ``point`` (a name unique within the step, the same on every rank) the ranks meet
    there inside ``step`` instead: before a collective whose arguments a trial checks, so
    that a rank whose call was wrong stops its peers before they enter the collective.
    """
    a = _AGREEMENT
    if a is None or a.world_size == 1:
        return
    at = f"{step}" if point is None else f"{step}/{point}"
    a.store.set(a.key(f"{at}/{a.rank}"), "passed")
    peers = [a.key(f"{at}/{r}") for r in range(a.world_size) if r != a.rank]
    deadline = time.monotonic() + AGREE_S
    while not a.store.check(peers):
        if (peer := a.failed()) is not None:
            raise _PeerFailed(peer)
        if time.monotonic() > deadline:
            late = [r for r in range(a.world_size) if r != a.rank and not a.store.check([a.key(f"{at}/{r}")])]
            who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
            raise Wrong(f"{who} did not finish this step within {AGREE_S:g} s of rank {a.rank}, which made "
                        f"{guard_count() - a.first} collectives in the trial so far: {who} waits in a collective "
                        "the other ranks never call (every rank must call the same collectives, in the same order), "
                        "or computes without end", step)
        time.sleep(_POLL_S)
    if point is None:
        a.step = step + 1


def guard_count() -> int:
    """Collectives issued on this rank so far (through :mod:`zerolearn.comm`, or by torch's names
    while watched)."""
    from zerolearn import guard

    return guard.current()


def run_trial(exercise: Exercise, fn: Callable, token: str | None = None) -> tuple[str, Any]:
    """Run ``exercise``'s trial with ``fn`` here; ``(kind, value, when)``: ``("ok", summary)``,
    ``("wrong", (step, message))``, ``("unwritten", None)`` or, on a rank that stopped because
    a peer failed first, ``("stopped", peer)``; ``when`` is the time (``time.time()``) of
    the verdict. Used on every rank and for in-process exercises.

    On ranks (``token`` given), the trial's :func:`agree` calls and any failure go through
    the process group's store under ``token``, and collectives are checked for
    agreement first (:func:`zerolearn.comm.set_debug`): a rank that calls another
    collective than its peers gets an error naming both, not a hang.
    """
    outcome = _run_trial(exercise, fn, token)
    return (*outcome, time.time())


def _run_trial(exercise: Exercise, fn: Callable, token: str | None) -> tuple[str, Any]:
    global _AGREEMENT
    debug = None
    if token is not None:
        from zerolearn import comm
        from zerolearn import dist as zdist

        ctx = zdist.context()
        _AGREEMENT = _Agreement(zdist.store(), token, ctx.rank, ctx.world_size, first=guard_count())
        debug = comm.debug_enabled()
        comm.set_debug(True)
    try:
        with watching(), pending_reads(readers_line) if exercise.async_reads else contextlib.nullcontext():
            return "ok", exercise.trial(fn)  # torch's collectives, by their own names, booked in comm.LEDGER
    except _PeerFailed as e:
        return "stopped", e.rank
    except Wrong as e:
        _post_failure()
        return "wrong", (e.step, str(e))
    except NotImplementedError:
        _post_failure()
        return "unwritten", None
    except Exception as e:  # noqa: BLE001 - the reader's error is the verdict
        _post_failure()
        step = _AGREEMENT.step if _AGREEMENT is not None and exercise.stepped else None  # the step it was in
        return "wrong", (step, _raised(e))
    finally:
        if token is not None:
            from zerolearn import comm

            comm.set_debug(debug)
            _AGREEMENT = None


def _post_failure() -> None:
    if _AGREEMENT is not None:
        _AGREEMENT.fail()


_POOLS: dict[int, Any] = {}
"""World size -> the ranks (:class:`zerolearn.live.Ranks`) that the checks of this process
run on: started by the first check that needs that many, kept for the next ones (a check
then answers in about a second instead of waiting for new processes to import torch), and
ended when the process exits, at the end of :func:`reusing_ranks` or by :func:`close_ranks`."""
_REUSING = 0  # depth of reusing_ranks() blocks


def close_ranks() -> None:
    """End the ranks the checks kept (their processes exit); the next check starts new ones."""
    while _POOLS:
        _POOLS.popitem()[1].close()


@contextlib.contextmanager
def reusing_ranks():
    """A block whose checks share ranks and end them when it ends (``check --all`` and the
    tests use it, so that no rank outlives them); checks outside any block keep theirs until
    the process exits. A block inside another shares the outer one's ranks.

    A rank that hangs is killed and its pool restarted by :mod:`zerolearn.live`, so a
    wrong function cannot leave a pool stuck.
    """
    global _REUSING
    _REUSING += 1
    try:
        yield
    finally:
        _REUSING -= 1
        if not _REUSING:
            close_ranks()


_LONGEST_S = 300.0
"""The kept ranks' own limit (their process group waits a minute more): above every exercise's
``timeout_s``, which each check passes as its call's limit."""
GRACE_S = 2.0
"""Seconds the other ranks get, once one rank has its verdict, to reach theirs (a failure at
the same step, or a stop at :func:`agree`); ranks still running then wait in a collective for
the rank that stopped, and are killed."""
_PEER_CAUSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "CollectiveError",
                "Socket Timeout", "Timed out waiting")  # what a rank reads when a peer stopped or died


def _decides(outcome) -> bool:
    return outcome[0] != "ok"


def _on_ranks(exercise: Exercise, fn: Callable, world_size: int) -> tuple[dict[int, tuple], dict[int, str],
                                                                             list[int]]:
    """Run the trial on ``world_size`` ranks until a verdict: (each finished rank's
    :func:`run_trial` outcome, each rank that died with its exit, the ranks killed unfinished).

    The kept ranks of that size (:data:`_POOLS`) run it, within the exercise's
    ``timeout_s``. Once one rank has a verdict the others get :data:`GRACE_S` seconds; a
    rank still running then is killed (it waits in a collective for the rank that
    stopped), and its pool restarts at the next call.
    """
    from zerolearn.live import CellError, Ranks

    token = uuid.uuid4().hex[:12]
    if world_size not in _POOLS:
        _POOLS[world_size] = Ranks(world_size, timeout_s=_LONGEST_S)
    pool = _POOLS[world_size]
    try:
        return pool.call_until(_decides, run_trial, exercise, fn, token, grace_s=GRACE_S,
                               timeout_s=exercise.timeout_s)
    except CellError:  # a rank of the pool died since its last call: the pool restarted, nothing ran
        return pool.call_until(_decides, run_trial, exercise, fn, token, grace_s=GRACE_S,
                               timeout_s=exercise.timeout_s)


def _peer_caused(kind: str, value) -> bool:
    """An outcome a peer's stop or death caused, not this rank's own verdict."""
    if kind == "stopped":
        return True
    return kind == "wrong" and value[1].startswith("your function raised") and \
        any(words in value[1] for words in _PEER_CAUSED)


def _verdict(name: str, outcomes: dict[int, tuple], world_size: int | None, died: dict[int, str] | None = None,
             cut: list[int] | None = None, timeout_s: float = 0.0) -> Result:
    """The first real verdict of any rank: the earliest step, then the earliest in time; what
    a peer's stop or death caused (a closed connection, say) only when no rank has its own."""
    real = [(r, o) for r, o in outcomes.items() if o[0] not in ("ok", "stopped") and not _peer_caused(*o[:2])]
    if real:
        def order(item):
            r, (kind, value, when) = item
            step = value[0] if kind == "wrong" and value[0] is not None else -1 if kind == "unwritten" else 1 << 30
            return step, when, r

        rank, (kind, value, _) = min(real, key=order)
        if kind == "unwritten":
            return Result(name, False, written=False)
        step, message = value
        return Result(name, False, mistake=Mistake(rank if world_size else None, step, message),
                      world_size=world_size)
    if died:
        rank = min(died)
        exit_line = died[rank].strip().splitlines()[-1] if died[rank].strip() else "died"
        message = (f"the rank's process ended ({exit_line}) inside the trial: gloo ends a rank whose collective "
                   "does not match its peers' (another operation, size or group)")
        return Result(name, False, mistake=Mistake(rank, None, message), world_size=world_size)
    secondary = sorted((r, o) for r, o in outcomes.items() if o[0] != "ok")
    if secondary:
        rank, (kind, value, _) = secondary[0]
        message = value[1] if kind == "wrong" else f"stopped because rank {value} failed"
        return Result(name, False, mistake=Mistake(rank, value[0] if kind == "wrong" else None, message),
                      world_size=world_size)
    if cut:
        who = f"rank {cut[0]}" if len(cut) == 1 else f"ranks {cut}"
        return Result(name, False, mistake=Mistake(None, None, f"{who} gave no result within {timeout_s:.0f} s: "
                                                   "a rank waits in a collective its peers never call, or never "
                                                   "returns"), world_size=world_size)
    return Result(name, True, world_size=world_size, summary=outcomes[min(outcomes)][1])


def _only_raises_not_implemented(fn: Callable) -> bool:
    """True for a function whose body (after its docstring) is ``raise NotImplementedError``
    alone, as the reader's copy leaves it; False when its source cannot be read (then the
    trial finds out on the ranks)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    if len(defs) != 1:
        return False
    body = defs[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def check(name: str, fn: Callable | None = None, *, solution: bool = False, bug: str | None = None,
          quiet: bool = False) -> Result:
    """Check the reader's ``fn`` for exercise ``name``; print and return the :class:`Result`.

    ``solution=True`` checks the reference solution, ``bug=NAME`` one of the known bugs
    instead of ``fn``. Rank exercises run on each of the exercise's world sizes in turn
    (gloo ranks, :class:`zerolearn.live.Ranks`, started by the first check that needs them
    and kept for the next: :data:`_POOLS`) and stop at the first one
    with a mistake; the verdict is the first real one of any rank (:func:`_verdict`),
    within seconds of it, whichever rank it is on. A function still raising NotImplementedError is "not written yet",
    not an error, so a reader's copy runs top to bottom.

    A program exercise (:mod:`zerolearn.exercises.program`) takes the script's file name
    for ``fn`` (``check("01.allreduce", "allreduce.py")``) and runs it under torchrun.

    Raises:
        ConfigError: unknown ``name`` or ``bug``, or not exactly one of ``fn``,
            ``solution``, ``bug`` given.
    """
    if name in PROGRAMS:
        return _check_program(PROGRAMS[name], fn, solution, bug, quiet)
    exercise = get(name)
    if sum([fn is not None, solution, bug is not None]) != 1:
        raise ConfigError("check: give exactly one of fn, solution=True, bug=NAME")
    if bug is not None and bug not in exercise.bugs:
        raise ConfigError(f"bug {bug!r} of {name}: allowed are {', '.join(exercise.bugs) or '(none)'}")
    if fn is None:
        fn = exercise.solution if solution else exercise.bugs[bug].fn
    if not callable(fn):
        raise ConfigError(f"check({name!r}, {fn!r}): expected the function you wrote")
    result = None
    if _only_raises_not_implemented(fn):  # the reader's copy's skeleton: said at once, no rank started
        result = Result(name, False, written=False)
    elif not exercise.world_sizes:
        result = _verdict(name, {0: run_trial(exercise, fn)}, None)
    else:
        for world_size in exercise.world_sizes:
            outcomes, died, cut = _on_ranks(exercise, fn, world_size)
            result = _verdict(name, outcomes, world_size, died, cut, exercise.timeout_s)
            if not result.passed:
                break
    if result.mistake is not None:
        mistake = result.mistake
        object.__setattr__(result, "mistake", Mistake(mistake.rank, mistake.step, _sourced(mistake.message, fn)))
    if not quiet:
        print(result)
        object.__setattr__(result, "shown", True)
    return result


def _check_program(program, path, solution: bool, bug: str | None, quiet: bool) -> Result:
    """:func:`check` for a program exercise: the script (:func:`~zerolearn.exercises.program.script_text`)
    said "not written yet" at once while its ``main()`` raises NotImplementedError, else run
    under torchrun (:func:`~zerolearn.exercises.program.first_mistake`)."""
    text = script_text(program, path, solution, bug)
    if unwritten(text):
        result = Result(program.name, False, written=False)
    elif (found := first_mistake(program, text)) is None:
        result = Result(program.name, True, summary=program.summary)
    else:
        world_size, rank, words = found
        result = Result(program.name, False, mistake=Mistake(rank, None, words), world_size=world_size)
    if not quiet:
        print(result if result.written else
              f"{program.name}: not written yet ({program.script}'s main() still raises NotImplementedError).")
        object.__setattr__(result, "shown", True)
    return result
