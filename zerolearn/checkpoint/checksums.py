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

from zerolearn.checkpoint.files import (
    CheckpointError,
    check_shard,
    check_size,
    complete,
    rank_file,
    read_manifest,
    resolve,
)
from zerolearn.checkpoint.manifest import Manifest

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


def _explain(man: Manifest, entry, size: int, digest: str | None) -> str:
    """Why the file of ``entry`` (``size`` bytes, SHA-256 ``digest``) is not the one the manifest lists."""
    full = os.path.join(man.path, rank_file(entry.rank))
    same_as = [f.file for f in man.files if digest and f.sha256 == digest and f is not entry]
    if same_as:
        return (f"{full}: its content is that of {same_as[0]} as saved, not rank {entry.rank}'s "
                "(shard files swapped or copied over each other?)")
    try:
        saved = torch.load(full, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any failure to read is a damaged file
        saved = None
    if isinstance(saved, dict):
        differ = [f"{k} {saved[k]!r} (the manifest says {v!r})" for k, v in entry.identity().items()
                  if k in saved and saved[k] != v]
        if differ:
            hint = (" (a shard copied in from another checkpoint?)" if saved.get("step") != entry.step
                    else " (shard files swapped or renamed?)" if saved.get("rank") != entry.rank else "")
            return f"{full}: holds the shard of " + ", ".join(differ) + hint
    if size != entry.bytes:
        return (f"{full}: {size} bytes, the manifest says {entry.bytes}: the file is truncated or was "
                "changed after the save")
    return (f"{full}: SHA-256 {digest[:16]}... differs from the manifest's {entry.sha256[:16]}...: "
            f"the file was damaged or changed after the save (flipped bits?"
            f"{'' if saved is not None else ' it cannot even be read'})")


def _check_contents(man: Manifest, rank: int) -> None:
    """Load rank ``rank``'s file (memory-mapped, ``weights_only``) and check it against the manifest."""
    full = os.path.join(man.path, rank_file(rank))
    try:
        saved = torch.load(full, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure to read is a damaged file
        raise CheckpointError(f"{full}: cannot be read ({type(e).__name__}: {e})") from None
    check_shard(man, rank, saved, full)


def verify(path: str, man: Manifest | None = None, ranks: set[int] | None = None) -> bool:
    """Check the shard files of checkpoint ``path`` against its manifest.

    Each file, at the path the loaders open (``rank_RRRRR.pt`` of its rank, which the
    manifest's schema requires its ``file`` to name), must be present with the
    recorded size and, when the manifest records checksums, the recorded SHA-256; it
    must then load (``weights_only``) and hold what the manifest says
    (:func:`zerolearn.checkpoint.files.check_shard`: its owner, each piece's group,
    range and tensors). ``man``: the manifest if already read (else
    :func:`~zerolearn.checkpoint.files.read_manifest` reads and checks it).
    ``ranks``: check only the files of these saving ranks (None: all), so that
    loading ranks can share the hashing.

    Returns: True if the contents were hashed, False for a checkpoint saved without
    checksums (sizes and structure checked only).

    Raises:
        CheckpointError: naming the first file that differs and what differs (size;
            content: another rank's or another step's shard, or damaged; a field that
            does not fit the manifest); or the manifest's problem (file and field).
    """
    if man is None:
        man = read_manifest(path, check_files=False)
    for entry in man.files:
        if ranks is not None and entry.rank not in ranks:
            continue
        full = os.path.join(man.path, rank_file(entry.rank))
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size is None or not man.checksums:
            check_size(man, entry)  # missing; or no checksum: the size is all there is
        else:
            try:
                digest = sha256_file(full)
            except OSError as e:
                raise CheckpointError(f"{full}: cannot be read ({e})") from None
            if size != entry.bytes or digest != entry.sha256:
                raise CheckpointError(_explain(man, entry, size, digest))
        _check_contents(man, entry.rank)
    return man.checksums


def verify_share(path: str, rank: int, world_size: int) -> str | None:
    """Loading rank ``rank``'s share of :func:`verify`: the files of the saving ranks r
    with r % ``world_size`` == ``rank`` (so the loading ranks read each file once).

    Returns: None if they verify, else what is wrong (never raises: every rank must
    report, or the others would wait in the next collective).
    """
    try:
        path = resolve(path)
        man = read_manifest(path, check_files=False)
        verify(path, man, {f.rank for f in man.files if f.rank % world_size == rank})
    except CheckpointError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"{type(e).__name__}: {e}"
    return None


def choose(directory: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint under ``directory`` that verifies (no collective).

    Any damage counts: a manifest that does not fit its schema (a missing or
    mistyped field, a step or offset that contradicts the folder or the layout), a
    shard that differs from it.

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
        except Exception as e:  # noqa: BLE001 - whatever the damage, the next one may verify
            skipped.append((path, f"{type(e).__name__}: {e}"))
            continue
        return path, None if checked else f"{path}: {NO_CHECKSUMS}", skipped
    if found:
        raise CheckpointError(f"{directory}: none of its {len(found)} checkpoint(s) verifies: "
                              + "; ".join(why for _, why in skipped))
    return None, None, []
