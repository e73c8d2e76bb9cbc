"""The checkpoint directory on disk: names, the manifest, reading pieces, consolidation.

Nothing here needs a process group: :func:`latest`, :func:`read_full` and
:func:`consolidate` work on a laptop on a checkpoint written by any number of ranks.
The format is described in :mod:`zerolearn.checkpoint`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch

from zerolearn.errors import ConfigError

FORMAT, VERSION = "zerolearn-checkpoint", 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged, incomplete or does not fit the model.

    Raised before any parameter is changed (the model is untouched).
    """


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, an I/O error, a file that did not
    verify when read back): a runtime failure, not bad input (the CLI exits with 1).

    The message names the rank(s) and the path. The previous checkpoints are intact.
    """


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".step_{step:08d}.tmp")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


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


def read_manifest(path: str, check_files: bool = True) -> dict:
    """The manifest of checkpoint ``path``, checked for completeness and consistency.

    Checks: the format and version, every rank file listed once and (unless
    ``check_files`` is False) present with the recorded size (a truncated or missing
    shard fails here; :func:`zerolearn.checkpoint.checksums.verify` also checks contents),
    and every element of every parameter held by some piece (else the checkpoint
    cannot be mapped onto any world size).

    Raises:
        CheckpointError: naming the file and what is wrong.
    """
    name = os.path.join(path, MANIFEST)
    try:
        with open(name) as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{name}: cannot be read as JSON ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
        raise CheckpointError(f"{name}: not a {FORMAT} manifest of version {VERSION}")
    files = man["files"]
    if sorted(f["rank"] for f in files) != list(range(man["world_size"])):
        raise CheckpointError(f"{name}: world size {man['world_size']} but rank files for ranks "
                              f"{sorted(f['rank'] for f in files)}; this checkpoint cannot be mapped")
    for f in files if check_files else []:
        check_size(path, man, f)
    for gi, g in enumerate(man["groups"]):
        held = sorted((start, stop) for _, start, stop, _ in g["pieces"])
        end = 0
        for start, stop in held:
            if start > end:
                break
            end = max(end, stop)
        if end < g["numel"]:
            raise CheckpointError(f"{name}: elements {end}.. of group {gi} ({g['names'][0]}, ...) are in no "
                                  f"rank's shard; this checkpoint cannot be mapped onto any world size")
    return man


def check_size(path: str, man: dict, entry: dict) -> int:
    """The size in bytes of the rank file of manifest entry ``entry``, checked.

    Raises:
        CheckpointError: the file is missing, or its size is not the recorded one.
    """
    full = os.path.join(path, entry["file"])
    if not os.path.isfile(full):
        raise CheckpointError(f"{path}: shard {entry['file']} of rank {entry['rank']} (of {man['world_size']}) "
                              "is missing")
    size = os.path.getsize(full)
    if size != entry["bytes"]:
        raise CheckpointError(f"{full}: {size} bytes, the manifest says {entry['bytes']}: the file is "
                              "truncated or was changed after the save")
    return size


class Reader:
    """Reads ranges of saved flat buffers, opening rank files lazily (memory-mapped).

    Memory-mapping means only the bytes actually copied are read from disk: loading
    one rank's new shard touches only the saved pieces that overlap it.
    """

    def __init__(self, path: str, manifest: dict):
        self.path, self.man = path, manifest
        self._files: dict[int, dict] = {}
        self.where = {}  # parameter name -> (group, offset, numel)
        for gi, g in enumerate(manifest["groups"]):
            for n, o, s in zip(g["names"], g["offsets"], g["shapes"]):
                self.where[n] = (gi, o, math.prod(s))

    def file(self, rank: int) -> dict:
        if rank not in self._files:
            name = os.path.join(self.path, rank_file(rank))
            try:
                self._files[rank] = torch.load(name, mmap=True, weights_only=True, map_location="cpu")
            except Exception as e:  # noqa: BLE001 - any failure to read is a damaged file
                raise CheckpointError(f"{name}: cannot be read ({type(e).__name__}: {e})") from None
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
        for rank, ps, pe, index in self.man["groups"][group]["pieces"]:
            lo, hi = max(start, ps), min(stop, pe)
            if lo >= hi:
                continue
            saved = self.piece(rank, index)
            table = saved if key == "master" else saved["state"]
            if key not in table or table[key].numel() != pe - ps:
                raise CheckpointError(f"{os.path.join(self.path, rank_file(rank))}: piece {index} has no "
                                      f"{pe - ps}-element {key!r}")
            out[lo - start:hi - start].copy_(table[key][lo - ps:hi - ps])

    def scalars(self, group: int) -> dict:
        """The optimizer's scalar state (e.g. Adam's ``step``) of saved group ``group``."""
        rank, _, _, index = self.man["groups"][group]["pieces"][0]
        return self.piece(rank, index)["scalars"]


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
    reader = Reader(path, man)
    out = {n: torch.empty(shape, dtype=torch.float32) for n, shape in man["params"]}
    for rank in range(man["world_size"]):
        for p in reader.file(rank)["pieces"]:
            table = p if key == "master" else p["state"]
            if key not in table:
                raise CheckpointError(f"{path}: {key!r} was not saved (saved: master, {', '.join(p['state'])})")
            g = man["groups"][p["group"]]
            for n, o, s in zip(g["names"], g["offsets"], g["shapes"]):
                lo, hi = max(p["start"], o), min(p["stop"], o + math.prod(s))
                if lo < hi:
                    out[n].view(-1)[lo - o:hi - o].copy_(table[key][lo - p["start"]:hi - p["start"]])
        reader.close(rank)  # unmap this shard before opening the next
    return out


def consolidate(path: str, out: str) -> dict[str, torch.Tensor]:
    """Write the full-precision ``state_dict`` of the model saved in ``path`` to ``out``.

    The result loads with ``model.load_state_dict(torch.load(out), strict=True)`` into
    the plain ``nn.Module``: trainable parameters in fp32 from the masters, tied
    names included, plus frozen parameters and buffers as rank 0 held them (floating
    ones as fp32). Every shard is first verified against the manifest (size and
    SHA-256; see :mod:`zerolearn.checkpoint.checksums`). Written to ``out.part`` and
    renamed when complete; on any failure no ``out.part`` is left. Returns it.

    Raises:
        CheckpointError: a shard does not verify (named, with what differs); see
            :func:`read_full`.
        OSError: ``out`` cannot be written.
    """
    from zerolearn.checkpoint.checksums import verify  # verify imports this module

    path = resolve(path)
    man = read_manifest(path, check_files=False)
    verify(path, man)
    state = read_full(path, "master")
    for key, name in man["aliases"].items():
        state[key] = state[name]
    if man["module_keys"]:
        module = Reader(path, man).file(0)["module"]
        for key in man["module_keys"]:
            t = module[key]
            state[key] = t.float().clone() if t.is_floating_point() else t.clone()
    write_atomic(out, lambda f: torch.save(state, f))
    return state
