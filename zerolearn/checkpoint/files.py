"""The checkpoint directory on disk: names, the manifest, reading pieces, output paths.

Nothing here needs a process group: :func:`latest` and :func:`read_full` (and
:func:`zerolearn.checkpoint.consolidate`, built on them) work on a laptop on a
checkpoint written by any number of ranks. The format is described in
:mod:`zerolearn.checkpoint`.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import shutil

import torch

from zerolearn.checkpoint.manifest import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    Manifest,
    rank_file,
)

_STEP_DIR = STEP_DIR


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, an I/O error, a file that did not
    verify when read back): a runtime failure, not bad input (the CLI exits with 1).

    The message names the rank(s) and the path. The previous checkpoints are intact.
    """


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".step_{step:08d}.tmp")


def complete(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under ``directory``, oldest first.

    Complete means renamed to ``step_NNNNNNNN`` with a manifest: a save that crashed
    leaves only a ``.step_*.tmp`` folder, which is ignored.
    """
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(directory, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def latest(directory: str) -> str | None:
    """Path of the newest complete checkpoint in ``directory``, or None if there is none."""
    found = complete(directory)
    return found[-1][1] if found else None


def resolve(path: str) -> str:
    """``path`` itself if it is a checkpoint, else its newest complete checkpoint.

    Raises:
        CheckpointError: neither.
    """
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint (no {MANIFEST} here, and no step_* "
                              "folder with one)")
    return found


def write_atomic(path: str, write) -> int:
    """Write ``path`` through ``write(file)`` into ``path.part``, fsync, rename; return bytes.

    If anything fails, ``path.part`` is removed (and ``path`` is untouched) before the
    error propagates.
    """
    part = path + ".part"
    try:
        with open(part, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        if os.path.exists(part):  # never leave a half-written file behind
            os.remove(part)
        raise
    return os.path.getsize(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def read_manifest(path: str, check_files: bool = True) -> Manifest:
    """The manifest of checkpoint ``path``, checked whole (:class:`Manifest`).

    Checks the schema and every cross-check of :mod:`zerolearn.checkpoint.manifest`
    (step against the folder's name, each shard's owner and file name, offsets and
    pieces against the layout), and (unless ``check_files`` is False) that every rank
    file is present with the recorded size; :func:`zerolearn.checkpoint.checksums.verify`
    also checks their contents.

    Raises:
        CheckpointError: naming the file and the field or what is wrong.
    """
    man = Manifest.read(path)
    for entry in man.files if check_files else []:
        check_size(man, entry)
    return man


def check_size(man: Manifest, entry) -> int:
    """The size in bytes of the rank file of manifest entry ``entry``, checked.

    Raises:
        CheckpointError: the file is missing, or its size is not the recorded one.
    """
    full = os.path.join(man.path, rank_file(entry.rank))
    if not os.path.isfile(full):
        raise CheckpointError(f"{man.path}: shard {entry.file} of rank {entry.rank} (of {man.world_size}) "
                              "is missing")
    size = os.path.getsize(full)
    if size != entry.bytes:
        raise CheckpointError(f"{full}: {size} bytes, the manifest says {entry.bytes}: the file is "
                              "truncated or was changed after the save")
    return size


def _tensor(saved: dict, key: str, numel: int, where: str) -> None:
    t = saved.get(key) if isinstance(saved, dict) else None
    if not torch.is_tensor(t) or t.dim() != 1 or t.numel() != numel or t.dtype != torch.float32:
        shown = f"{t.dtype} {list(t.shape)}" if torch.is_tensor(t) else type(t).__name__
        raise CheckpointError(f"{where} {key!r}: {shown}, the manifest implies float32 [{numel}]")


def check_shard(man: Manifest, rank: int, saved, name: str) -> None:
    """Check rank ``rank``'s loaded file ``saved`` (read from ``name``) against the manifest.

    Its recorded owner (rank, step, world size, stage, dtype) must be the manifest's
    entry's, and its pieces those the manifest gives this rank, in order: the same
    group, start and stop, an fp32 master of stop - start elements and the same for
    each of ``state_keys``. Rank 0's file holds the frozen tensors of ``module_keys``.

    Raises:
        CheckpointError: naming the file and the field that differs.
    """
    if not isinstance(saved, dict):
        raise CheckpointError(f"{name}: holds a {type(saved).__name__}, not a shard")
    entry = man.files[rank]
    differ = [f"{k} {saved.get(k)!r} (the manifest says {v!r})" for k, v in entry.identity().items()
              if saved.get(k) != v]
    if differ:
        hint = (" (a shard copied in from another checkpoint?)" if saved.get("step") != entry.step
                else " (shard files swapped or renamed?)" if saved.get("rank") != entry.rank else "")
        raise CheckpointError(f"{name}: holds the shard of " + ", ".join(differ) + hint)
    mine, pieces = man.pieces_of(rank), saved.get("pieces")
    if not isinstance(pieces, list) or len(pieces) != len(mine):
        raise CheckpointError(f"{name}: pieces: {len(pieces) if isinstance(pieces, list) else pieces!r}, the "
                              f"manifest lists {len(mine)} for rank {rank}")
    for (gi, p), got in zip(mine, pieces, strict=True):
        where = f"{name}: pieces[{p.index}]"
        if not isinstance(got, dict) or [got.get(k) for k in ("group", "start", "stop")] != [gi, p.start, p.stop]:
            shown = [got.get(k) for k in ("group", "start", "stop")] if isinstance(got, dict) else got
            raise CheckpointError(f"{where}: (group, start, stop) {shown}, the manifest says "
                                  f"{[gi, p.start, p.stop]}")
        _tensor(got, "master", p.stop - p.start, where)
        state = got.get("state")
        if not isinstance(state, dict) or sorted(state) != sorted(man.state_keys):
            raise CheckpointError(f"{where}: state {sorted(state) if isinstance(state, dict) else state!r}, the "
                                  f"manifest's state_keys are {list(man.state_keys)}")
        for key in man.state_keys:
            _tensor(state, key, p.stop - p.start, f"{where}.state")
        if not isinstance(got.get("scalars"), dict):
            raise CheckpointError(f"{where}: scalars missing")
    rng = saved.get("rng")
    if not isinstance(rng, dict) or not torch.is_tensor(rng.get("torch")):
        raise CheckpointError(f"{name}: rng: missing or not a random state")
    if rank == 0:
        module = saved.get("module")
        if not isinstance(module, dict) or sorted(module) != sorted(man.module_keys) or not all(
                torch.is_tensor(t) for t in module.values()):
            raise CheckpointError(f"{name}: module: {sorted(module) if isinstance(module, dict) else module!r}, "
                                  f"the manifest's module_keys are {list(man.module_keys)}")


def load_shard(man: Manifest, rank: int, hashed: bool = False) -> dict:
    """Rank ``rank``'s file of checkpoint ``man.path``, checked (:func:`check_shard`).

    ``hashed``: read the file into memory once, check those bytes' size and SHA-256
    against the manifest, and load the tensors from the same bytes, so that what was
    checked is exactly what is loaded (memory: the file's size, twice while loading).
    Otherwise the file is memory-mapped (only the bytes copied out are read; the
    caller verified it just before, at this same path). A checkpoint saved without
    checksums is memory-mapped either way. Always ``torch.load(..., weights_only=True)``:
    a file holding anything but tensors and plain containers is refused, never run.

    Raises:
        CheckpointError: the file cannot be read, its bytes differ from the manifest's
            record, or it does not fit the manifest.
    """
    name = os.path.join(man.path, rank_file(rank))
    entry = man.files[rank]
    try:
        if hashed and entry.sha256 is not None:
            with open(name, "rb") as f:
                data = f.read()
            if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
                raise CheckpointError(f"{name}: the bytes read ({len(data)}) are not those the manifest records "
                                      f"({entry.bytes} bytes, SHA-256 {entry.sha256[:16]}...): the file changed "
                                      "after it was verified")
            saved = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            del data
        else:
            saved = torch.load(name, mmap=True, weights_only=True, map_location="cpu")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read is a damaged file
        raise CheckpointError(f"{name}: cannot be read ({type(e).__name__}: {e})") from None
    check_shard(man, rank, saved, name)
    return saved


class Reader:
    """Reads ranges of saved flat buffers, opening rank files lazily (memory-mapped).

    ``hashed`` (loading into an engine): each file is read whole, and its bytes hashed
    and loaded (:func:`load_shard`). Otherwise (consolidation, after verifying) files
    are memory-mapped: only the bytes actually copied are read from disk. Every file
    is checked against the manifest when opened (:func:`check_shard`).
    """

    def __init__(self, man: Manifest, hashed: bool = False):
        self.path, self.man, self.hashed = man.path, man, hashed
        self._files: dict[int, dict] = {}
        self.where = {}  # parameter name -> (group, offset, numel)
        for gi, g in enumerate(man.groups):
            for n, o, s in zip(g.names, g.offsets, g.shapes, strict=True):
                self.where[n] = (gi, o, math.prod(s))

    def file(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = load_shard(self.man, rank, self.hashed)
        return self._files[rank]

    def close(self, rank: int | None = None) -> None:
        """Drop open files (all, or one rank's), unmapping their memory."""
        for r in ([rank] if rank is not None else list(self._files)):
            self._files.pop(r, None)

    def piece(self, rank: int, index: int) -> dict:
        return self.file(rank)["pieces"][index]

    def read(self, group: int, start: int, stop: int, key: str, out: torch.Tensor) -> None:
        """Copy elements [start, stop) of saved group ``group``'s ``key`` buffer into ``out``.

        ``key`` is ``"master"`` (fp32 parameters) or an optimizer state name (e.g.
        ``"exp_avg"``). ``out`` has ``stop - start`` elements.
        """
        for p in self.man.groups[group].pieces:
            lo, hi = max(start, p.start), min(stop, p.stop)
            if lo >= hi:
                continue
            saved = self.piece(p.rank, p.index)
            table = saved if key == "master" else saved["state"]
            out[lo - start:hi - start].copy_(table[key][lo - p.start:hi - p.start])

    def scalars(self, group: int) -> dict:
        """The optimizer's scalar state (e.g. Adam's ``step``) of saved group ``group``."""
        p = self.man.groups[group].pieces[0]
        return self.piece(p.rank, p.index)["scalars"]


def read_full(path: str, key: str = "master") -> dict[str, torch.Tensor]:
    """Every trainable parameter's full fp32 ``key`` buffer, by name, shaped as the parameter.

    Streams rank file by rank file (each memory-mapped and released before the next),
    so memory stays near the output plus one shard. ``path``: a checkpoint or a folder
    of them (the newest is read).

    Raises:
        CheckpointError: see :func:`read_manifest`; ``key`` not saved.
    """
    path = resolve(path)
    man = read_manifest(path)
    if key != "master" and key not in man.state_keys:
        raise CheckpointError(f"{path}: {key!r} was not saved (saved: master, {', '.join(man.state_keys)})")
    reader = Reader(man)
    out = {n: torch.empty(shape, dtype=torch.float32) for n, shape in man.params}
    for rank in range(man.world_size):
        for gi, p in man.pieces_of(rank):
            saved = reader.piece(rank, p.index)
            table = saved if key == "master" else saved["state"]
            g = man.groups[gi]
            for n, o, s in zip(g.names, g.offsets, g.shapes, strict=True):
                lo, hi = max(p.start, o), min(p.stop, o + math.prod(s))
                if lo < hi:
                    out[n].view(-1)[lo - o:hi - o].copy_(table[key][lo - p.start:hi - p.start])
        reader.close(rank)  # unmap this shard before opening the next
    return out


def inside_checkpoint(out: str, sources: tuple[str, ...] = ()) -> str | None:
    """The checkpoint folder ``out`` lies in, or None.

    ``out`` lies in one if any folder above it (symbolic links followed) is one of
    ``sources``, holds a ``manifest.json`` (a checkpoint), or holds ``step_NNNNNNNN``
    checkpoints or ``.step_*.tmp`` saves (a checkpoint directory).
    """
    given = {os.path.realpath(s) for s in sources}
    d = os.path.dirname(os.path.realpath(out))
    while True:
        if d in given or os.path.isfile(os.path.join(d, MANIFEST)) or complete(d):
            return d
        try:
            if any(n.startswith(".step_") and n.endswith(".tmp") for n in os.listdir(d)):
                return d
        except OSError:
            pass
        up = os.path.dirname(d)
        if up == d:
            return None
        d = up


def check_out(out: str, sources: tuple[str, ...] = ()) -> None:
    """Refuse an output file ``out`` that cannot be written or would land in a checkpoint.

    Raises:
        CheckpointError: ``out`` ends in a path separator or is a folder, its folder
            does not exist or cannot be reached, or it lies inside a checkpoint
            (writing it there could overwrite the checkpoint's own files).
    """
    if not out or out.endswith((os.sep, "/")) or os.path.isdir(out):
        raise CheckpointError(f"OUT {out!r}: a folder; give a file name (e.g. model.pt)")
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.stat(parent)
    except OSError as e:
        raise CheckpointError(f"OUT {out}: its folder {parent} cannot be reached ({e.strerror})") from None
    if not os.path.isdir(parent):
        raise CheckpointError(f"OUT {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"OUT {out}: the folder {parent} is not writable")
    inside = inside_checkpoint(out, sources)
    if inside is not None:
        raise CheckpointError(f"OUT {out}: inside the checkpoint directory {inside}; write it elsewhere (a "
                              "checkpoint's files are never overwritten)")
