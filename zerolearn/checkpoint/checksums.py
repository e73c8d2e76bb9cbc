"""Checksums: every shard file checked against its manifest before anyone trusts it.

The manifest records, per rank file, its size, its SHA-256 and what it belongs to
(``rank``, ``step``, ``world_size``, ``stage``, ``dtype``; the file itself records
the same, so a misplaced file can say where it came from). :func:`verify` re-hashes
the files and raises :class:`CheckpointError` naming the first file that differs and
how: a flipped byte, a truncated file, two ranks' files swapped, a shard copied in
from another checkpoint.

Checkpoints written before checksums were recorded (no ``sha256`` in ``files``)
still load: their sizes are checked as before and :func:`verify` returns False, so
that callers can say the content was not checked (see :func:`choose`).
"""

from __future__ import annotations

import hashlib
import os

import torch

from zerolearn.checkpoint.files import CheckpointError, check_size, complete, read_manifest, resolve

# What each shard belongs to: recorded in the manifest and in the file itself.
IDENTITY = ("rank", "step", "world_size", "stage", "dtype")
NO_CHECKSUMS = "saved without checksums (by an older zerolearn): shard sizes checked, contents not"


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of the file ``path``, read in ``chunk``-byte pieces (memory: one chunk).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _explain(path: str, entry: dict, man: dict, size: int, digest: str | None) -> str:
    """Why the file of ``entry`` (``size`` bytes, SHA-256 ``digest``) is not the one the manifest lists."""
    full = os.path.join(path, entry["file"])
    same_as = [f["file"] for f in man["files"] if digest and f.get("sha256") == digest and f is not entry]
    if same_as:
        return (f"{full}: its content is that of {same_as[0]} as saved, not rank {entry['rank']}'s "
                "(shard files swapped or copied over each other?)")
    try:
        saved = torch.load(full, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any failure to read is a damaged file
        saved = None
    if isinstance(saved, dict):
        differ = [f"{k} {saved[k]!r} (the manifest says {entry[k]!r})" for k in IDENTITY
                  if k in saved and k in entry and saved[k] != entry[k]]
        if differ:
            hint = (" (a shard copied in from another checkpoint?)" if saved.get("step") != entry.get("step")
                    else " (shard files swapped or renamed?)" if saved.get("rank") != entry.get("rank") else "")
            return f"{full}: holds the shard of " + ", ".join(differ) + hint
    if size != entry["bytes"]:
        return (f"{full}: {size} bytes, the manifest says {entry['bytes']}: the file is truncated or was "
                "changed after the save")
    return (f"{full}: SHA-256 {digest[:16]}... differs from the manifest's {entry['sha256'][:16]}...: "
            f"the file was damaged or changed after the save (flipped bits?"
            f"{'' if saved is not None else ' it cannot even be read'})")


def verify(path: str, man: dict | None = None, ranks: set[int] | None = None) -> bool:
    """Check the shard files of checkpoint ``path`` against its manifest.

    Each file must be present with the recorded size and, when the manifest records
    checksums, the recorded SHA-256. ``man``: the manifest if already read (else
    :func:`~zerolearn.checkpoint.files.read_manifest` reads and checks it).
    ``ranks``: check only the files of these saving ranks (None: all), so that
    loading ranks can share the hashing. Reads every checked file once.

    Returns: True if the contents were checked, False for a checkpoint saved without
    checksums (sizes checked only).

    Raises:
        CheckpointError: naming the first file that differs and what differs (size;
            content: another rank's or another step's shard, or damaged); or the
            manifest's problem.
    """
    if man is None:
        man = read_manifest(path, check_files=False)
    checksums = all("sha256" in f for f in man["files"])
    for entry in man["files"]:
        if ranks is not None and entry["rank"] not in ranks:
            continue
        full = os.path.join(path, entry["file"])
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size is None or not checksums:
            check_size(path, man, entry)  # missing; or no checksum: the size is all there is
            continue
        try:
            digest = sha256_file(full)
        except OSError as e:
            raise CheckpointError(f"{full}: cannot be read ({e})") from None
        if size != entry["bytes"] or digest != entry["sha256"]:
            raise CheckpointError(_explain(path, entry, man, size, digest))
    return checksums


def verify_share(path: str, rank: int, world_size: int) -> str | None:
    """Loading rank ``rank``'s share of :func:`verify`: the files of the saving ranks r
    with r % ``world_size`` == ``rank`` (so the loading ranks read each file once).

    Returns: None if they verify, else what is wrong (never raises: every rank must
    report, or the others would wait in the next collective).
    """
    try:
        path = resolve(path)
        man = read_manifest(path, check_files=False)
        verify(path, man, {f["rank"] for f in man["files"] if f["rank"] % world_size == rank})
    except CheckpointError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"{type(e).__name__}: {e}"
    return None


def choose(directory: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint under ``directory`` that verifies (no collective).

    Returns: (its path or None if there is no complete checkpoint, a note or None,
    (path, reason) of each newer one that failed, newest first). The note is
    :data:`NO_CHECKSUMS` for a checkpoint saved without checksums.

    Raises:
        CheckpointError: there are complete checkpoints but none verifies (each
            one's reason given).
    """
    found = complete(directory)
    skipped = []
    for _, path in reversed(found):
        try:
            checked = verify(path)
        except CheckpointError as e:
            skipped.append((path, str(e)))
            continue
        return path, None if checked else f"{path}: {NO_CHECKSUMS}", skipped
    if found:
        raise CheckpointError(f"{directory}: none of its {len(found)} checkpoint(s) verifies: "
                              + "; ".join(why for _, why in skipped))
    return None, None, []
