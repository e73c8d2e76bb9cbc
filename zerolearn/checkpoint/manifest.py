"""The manifest of a checkpoint: one schema, checked whole before anything uses it.

:meth:`Manifest.from_json` turns the parsed ``manifest.json`` into frozen dataclasses
and refuses anything that does not fit, naming the file and the field
(``groups[0].offsets[1]``): a missing key, a value of the wrong type or out of range,
and every field that can be checked against another:

* ``step`` against the folder's name (``step_00000004`` holds step 4) and against
  each shard's recorded ``step``; each shard's ``rank``, ``world_size``, ``stage`` and
  ``dtype`` against the manifest's;
* each shard's ``file`` against the rank that reads it (``rank_00001.pt`` is rank 1's:
  the file hashed is the file loaded);
* each group's ``offsets``, ``numel`` and ``padded_numel`` against the layout its
  ``shapes`` imply (parameters end to end, padded to equal shards,
  :class:`zerolearn.flat.FlatLayout`), and its ``pieces`` against the shards that
  ``stage`` on ``world_size`` ranks hold (stage 0: rank 0 holds the whole buffer;
  stages 1-3: rank r holds elements [r S, (r + 1) S), S = padded_numel / world_size);
* every piece index: rank r's pieces are numbered 0, 1, ... in group order, as its
  file lists them.

What the shard files hold is checked against the same schema when they are read
(:func:`zerolearn.checkpoint.checksums.verify`). The format itself is described in
:mod:`zerolearn.checkpoint`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from zerolearn.errors import ConfigError
from zerolearn.precision import DTYPES

FORMAT, VERSION = "zerolearn-checkpoint", 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def rank_file(rank: int) -> str:
    """The shard file of saving rank ``rank``: ``rank_RRRRR.pt``."""
    return f"rank_{rank:05d}.pt"


def shards(stage: int, world_size: int) -> int:
    """Equal shards each flat group is cut into: 1 at stage 0 (nothing sharded), else Nd."""
    return 1 if stage == 0 else world_size


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged, incomplete or does not fit the model.

    Raised before any parameter is changed (the model is untouched).
    """


class ManifestError(CheckpointError):
    """A manifest that does not fit the schema; ``str(e)`` names the file and the field."""


@dataclass(frozen=True)
class FileEntry:
    """One shard file: its name, size in bytes, SHA-256 (None: saved before checksums)
    and what it belongs to (``rank``, ``step``, ``world_size``, ``stage``, ``dtype``)."""

    file: str
    bytes: int
    sha256: str | None
    rank: int
    step: int
    world_size: int
    stage: int
    dtype: str

    def identity(self) -> dict:
        """What the shard belongs to, as the file itself records it."""
        return {"rank": self.rank, "step": self.step, "world_size": self.world_size, "stage": self.stage,
                "dtype": self.dtype}


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a group's flat buffer: piece ``index`` of ``rank``'s file."""

    rank: int
    start: int
    stop: int
    index: int


@dataclass(frozen=True)
class Group:
    """One flat group: its parameters (names, shapes, offsets in elements), its size
    unpadded and padded (elements), and the pieces that hold it."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Scaler:
    """The fp16 loss scaler's state (:class:`zerolearn.precision.LossScaler`)."""

    enabled: bool
    scale: float
    clean_steps: int
    skipped_steps: int

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}


@dataclass(frozen=True)
class Manifest:
    """A checked manifest (format in :mod:`zerolearn.checkpoint`); build it with :meth:`read`
    or :meth:`from_json`, never by hand.

    ``path`` is the checkpoint folder it was read from; ``checksums`` says whether every
    file entry records a SHA-256 (False: saved by an older zerolearn).
    """

    path: str
    step: int
    stage: int
    world_size: int
    optimizer: str
    dtype: str
    torch: str
    scaler: Scaler
    params: tuple[tuple[str, tuple[int, ...]], ...]
    skipped: dict[str, int]
    state_keys: tuple[str, ...]
    groups: tuple[Group, ...]
    aliases: dict
    module_keys: tuple[str, ...]
    files: tuple[FileEntry, ...]
    extra: dict

    @property
    def checksums(self) -> bool:
        return all(f.sha256 is not None for f in self.files)

    def pieces_of(self, rank: int) -> list[tuple[int, Piece]]:
        """(group index, piece) of every piece in ``rank``'s file, in the file's order."""
        found = [(gi, p) for gi, g in enumerate(self.groups) for p in g.pieces if p.rank == rank]
        return sorted(found, key=lambda item: item[1].index)

    @classmethod
    def read(cls, path: str) -> Manifest:
        """Read and check ``path/manifest.json``.

        Raises:
            ManifestError: the file cannot be read, is not JSON, or does not fit the
                schema (the message names the file and the field).
        """
        name = os.path.join(path, MANIFEST)
        try:
            with open(name, "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ManifestError(f"{name}: cannot be read as JSON ({type(e).__name__}: {e})") from None
        return cls.from_json(data, path)

    @classmethod
    def from_json(cls, data, path: str) -> Manifest:
        """The manifest of checkpoint folder ``path`` from its parsed JSON ``data``, checked whole.

        Raises:
            ManifestError: naming ``path/manifest.json`` and the first field that is
                missing, of the wrong type, out of range, or inconsistent with another.
        """
        c = _Checker(os.path.join(path, MANIFEST))
        top = c.obj(data, "the manifest")
        if top.get("format") != FORMAT or top.get("version") != VERSION:
            c.fail("format, version", f"not a {FORMAT} manifest of version {VERSION}")
        step = c.count(c.key(top, "step"), "step", 0)
        folder = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        if folder and int(folder.group(1)) != step:
            c.fail("step", f"{step}, but the folder {os.path.basename(os.path.normpath(path))} holds step "
                           f"{int(folder.group(1))} (the manifest was edited or moved)")
        stage = c.count(c.key(top, "stage"), "stage", 0, 3)
        world = c.count(c.key(top, "world_size"), "world_size", 1)
        dtype = c.choice(c.key(top, "dtype"), "dtype", tuple(DTYPES))
        optimizer = c.text(c.key(top, "optimizer"), "optimizer")
        version = c.text(c.key(top, "torch"), "torch")
        scaler = _scaler(c, c.obj(c.key(top, "scaler"), "scaler"))
        params = _params(c, c.array(c.key(top, "params"), "params"))
        skipped = _skipped(c, top.get("skipped", {}), dict(params), step)
        state_keys = tuple(c.text(k, f"state_keys[{i}]")
                           for i, k in enumerate(c.array(c.key(top, "state_keys"), "state_keys")))
        c.unique(state_keys, "state_keys")
        files = _files(c, c.array(c.key(top, "files"), "files"), step, stage, world, dtype)
        groups = _groups(c, c.array(c.key(top, "groups"), "groups"), dict(params), stage, world)
        aliases = c.obj(c.key(top, "aliases"), "aliases")
        for k, v in aliases.items():
            if c.text(v, f"aliases[{k!r}]") not in dict(params):
                c.fail(f"aliases[{k!r}]", f"{v!r} is not a saved parameter")
        module_keys = tuple(c.text(k, f"module_keys[{i}]")
                            for i, k in enumerate(c.array(c.key(top, "module_keys"), "module_keys")))
        c.unique(module_keys, "module_keys")
        extra = c.obj(c.key(top, "extra"), "extra")
        return cls(path, step, stage, world, optimizer, dtype, version, scaler, params, skipped, state_keys, groups,
                   dict(aliases), module_keys, files, dict(extra))


class _Checker:
    """Type and range checks that raise ManifestError naming the manifest file and field."""

    def __init__(self, name: str):
        self.name = name

    def fail(self, field: str, problem: str):
        raise ManifestError(f"{self.name}: {field}: {problem}")

    def key(self, obj: dict, key: str, where: str = ""):
        if key not in obj:
            self.fail(f"{where}{key}", "missing")
        return obj[key]

    def obj(self, value, field: str) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"{_kind(value)}, must be an object")
        return value

    def array(self, value, field: str, length: int | None = None) -> list:
        if not isinstance(value, list):
            self.fail(field, f"{_kind(value)}, must be a list")
        if length is not None and len(value) != length:
            self.fail(field, f"{len(value)} entries, must be {length}")
        return value

    def count(self, value, field: str, low: int = 0, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None
                                                                                   and value > high):
            allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
            self.fail(field, f"{value!r}, must be {allowed}")
        return value

    def text(self, value, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"{_kind(value)}, must be a string")
        return value

    def choice(self, value, field: str, allowed: tuple) -> str:
        if value not in allowed:
            self.fail(field, f"{value!r}, allowed are {', '.join(allowed)}")
        return value

    def unique(self, values, field: str) -> None:
        seen = set()
        for v in values:
            if v in seen:
                self.fail(field, f"{v!r} appears twice")
            seen.add(v)


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def _scaler(c: _Checker, s: dict) -> Scaler:
    enabled = s.get("enabled")
    if not isinstance(enabled, bool):
        c.fail("scaler.enabled", f"{_kind(enabled)}, must be true or false")
    scale = c.key(s, "scale", "scaler.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        c.fail("scaler.scale", f"{scale!r}, must be a finite number > 0")
    return Scaler(enabled, float(scale), c.count(c.key(s, "clean_steps", "scaler."), "scaler.clean_steps"),
                  c.count(c.key(s, "skipped_steps", "scaler."), "scaler.skipped_steps"))


def _shape(c: _Checker, value, field: str) -> tuple[int, ...]:
    return tuple(c.count(n, f"{field}[{i}]") for i, n in enumerate(c.array(value, field)))


def _params(c: _Checker, params: list) -> tuple:
    out = []
    for i, p in enumerate(params):
        name, shape = c.array(p, f"params[{i}]", 2)
        out.append((c.text(name, f"params[{i}][0]"), _shape(c, shape, f"params[{i}][1]")))
    c.unique([n for n, _ in out], "params (names)")
    return tuple(out)


def _skipped(c: _Checker, skipped, params: dict, step: int) -> dict[str, int]:
    """Optimizer steps each parameter sat out, unused on every rank (absent: none)."""
    out = {}
    for name, n in c.obj(skipped, "skipped").items():
        if name not in params:
            c.fail(f"skipped[{name!r}]", "not a saved parameter")
        out[name] = c.count(n, f"skipped[{name!r}]", 0, step)
    return out


def _files(c: _Checker, files: list, step: int, stage: int, world: int, dtype: str) -> tuple[FileEntry, ...]:
    ranks = []
    for i, f in enumerate(files):
        ranks.append(c.count(c.key(c.obj(f, f"files[{i}]"), "rank", f"files[{i}]."), f"files[{i}].rank"))
    if sorted(ranks) != list(range(world)):
        c.fail("files", f"world size {world} but rank files for ranks {sorted(ranks)}; this checkpoint cannot "
                        "be mapped")
    out = []
    for i, f in enumerate(files):
        at = f"files[{i}]"
        rank = f["rank"]
        name = c.text(c.key(f, "file", f"{at}."), f"{at}.file")
        if name != rank_file(rank):
            c.fail(f"{at}.file", f"{name!r}, but rank {rank}'s shard is {rank_file(rank)!r} (the file read for "
                                 f"rank {rank}); the manifest must name the file that is loaded")
        digest = f.get("sha256")
        if digest is not None and not (isinstance(digest, str) and _SHA256.match(digest)):
            c.fail(f"{at}.sha256", f"{_kind(digest)}, must be 64 lower-case hex digits")
        size = c.count(c.key(f, "bytes", f"{at}."), f"{at}.bytes", 1)
        for key, want in (("step", step), ("world_size", world), ("stage", stage), ("dtype", dtype)):
            if c.key(f, key, f"{at}.") != want:
                c.fail(f"{at}.{key}", f"{f[key]!r}, but the manifest's {key} is {want!r}")
        out.append(FileEntry(name, size, digest, rank, step, world, stage, dtype))
    return tuple(sorted(out, key=lambda e: e.rank))


def _groups(c: _Checker, groups: list, params: dict, stage: int, world: int) -> tuple[Group, ...]:
    out, seen, counts = [], set(), [0] * world
    n = shards(stage, world)
    for gi, g in enumerate(groups):
        at = f"groups[{gi}]"
        g = c.obj(g, at)
        names = c.array(c.key(g, "names", f"{at}."), f"{at}.names")
        shapes = c.array(c.key(g, "shapes", f"{at}."), f"{at}.shapes", len(names))
        offsets = c.array(c.key(g, "offsets", f"{at}."), f"{at}.offsets", len(names))
        if not names:
            c.fail(f"{at}.names", "empty, a group holds at least one parameter")
        total, shaped = 0, []
        for i, name in enumerate(names):
            c.text(name, f"{at}.names[{i}]")
            shape = _shape(c, shapes[i], f"{at}.shapes[{i}]")
            if name not in params or params[name] != shape:
                c.fail(f"{at}.names[{i}]", f"{name!r} {list(shape)} is not in params as such")
            if name in seen:
                c.fail(f"{at}.names[{i}]", f"{name!r} is in two groups")
            seen.add(name)
            if c.count(offsets[i], f"{at}.offsets[{i}]") != total:
                c.fail(f"{at}.offsets[{i}]", f"{offsets[i]}, but the shapes before it imply {total} (parameters "
                                             "lie end to end)")
            total += math.prod(shape)
            shaped.append(shape)
        numel = c.count(c.key(g, "numel", f"{at}."), f"{at}.numel")
        if numel != total:
            c.fail(f"{at}.numel", f"{numel}, but its shapes hold {total} elements")
        pieces = []
        for pi, p in enumerate(c.array(c.key(g, "pieces", f"{at}."), f"{at}.pieces")):
            rank, start, stop, index = c.array(p, f"{at}.pieces[{pi}]", 4)
            pieces.append(Piece(c.count(rank, f"{at}.pieces[{pi}][0]", 0, world - 1),
                                c.count(start, f"{at}.pieces[{pi}][1]"), c.count(stop, f"{at}.pieces[{pi}][2]"),
                                c.count(index, f"{at}.pieces[{pi}][3]")))
        got = sorted((p.rank, p.start, p.stop) for p in pieces)
        held = _uncovered(got, numel)
        if held is not None:
            c.fail(f"{at}.pieces", f"elements {held}.. of group {gi} ({names[0]}, ...) are in no rank's shard; "
                                   "this checkpoint cannot be mapped onto any world size")
        padded = c.count(c.key(g, "padded_numel", f"{at}."), f"{at}.padded_numel")
        if padded != math.ceil(total / n) * n:
            c.fail(f"{at}.padded_numel", f"{padded}, but {total} elements in {n} equal shard(s) (stage {stage}, "
                                         f"{world} rank(s)) make {math.ceil(total / n) * n}")
        size = padded // n
        want = [(r, r * size, (r + 1) * size) for r in range(n)]
        if got != want:
            c.fail(f"{at}.pieces", f"{[list(p) for p in got]}, but stage {stage} on {world} rank(s) holds "
                                   f"{[list(p) for p in want]} (rank, start, stop): pieces misplaced")
        for p in sorted(pieces, key=lambda p: p.rank):
            if p.index != counts[p.rank]:
                c.fail(f"{at}.pieces", f"rank {p.rank}'s piece of group {gi} has index {p.index}; its file lists "
                                       f"its pieces in group order, so it is {counts[p.rank]}")
            counts[p.rank] += 1
        out.append(Group(tuple(names), tuple(shaped), tuple(offsets), numel, padded, tuple(pieces)))
    missing = [n for n in params if n not in seen]
    if missing:
        c.fail("groups", f"parameters in no group: {', '.join(missing[:5])}")
    return tuple(out)


def _uncovered(pieces: list[tuple[int, int, int]], numel: int) -> int | None:
    """The first element of [0, numel) that no piece holds, or None."""
    end = 0
    for _, start, stop in sorted(pieces, key=lambda p: p[1]):
        if start > end:
            break
        end = max(end, stop)
    return end if end < numel else None
