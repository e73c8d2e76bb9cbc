"""One job per checkpoint directory: the lock file ``DIR/.lock``.

A training job with ``--checkpoint-dir DIR`` takes the lock (rank 0, the writer of
the manifest) for its whole run; a second job on the same directory is refused
before it trains. The lock is an OS file lock (``flock``, through the ``filelock``
library): the kernel releases it when its process ends, even by SIGKILL, so a job
that crashed never leaves the directory locked.

:func:`zerolearn.checkpoint.save` removes the leftovers of crashed saves
(``.step_*.tmp``, ``step_*.old``) only while this process holds the lock, or can take
it for that moment: never while another job, which may be writing them, holds it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import filelock

from zerolearn.checkpoint.files import CheckpointError

LOCK_NAME = ".lock"
_HELD: dict[str, filelock.BaseFileLock] = {}  # realpath of a directory -> its lock, held by this process


class CheckpointLockedError(CheckpointError):
    """Another job holds the lock of the checkpoint directory (a ConfigError: exit 2)."""


def lock_path(directory: str) -> str:
    """The lock file of checkpoint directory ``directory``."""
    return os.path.join(directory, LOCK_NAME)


def holds(directory: str) -> bool:
    """Whether this process holds the lock of ``directory``."""
    return os.path.realpath(directory) in _HELD


def acquire(directory: str) -> None:
    """Take the lock of ``directory`` for this process, without waiting.

    Creates ``directory`` (and the lock file) if needed. Taking a lock this process
    already holds does nothing. Hold it until :func:`release`, or until the process
    ends (the OS releases it then).

    Raises:
        CheckpointLockedError: another process holds it (the message names the
            directory and the lock file).
        OSError: the directory or the lock file cannot be created, or the file
            system cannot lock files.
    """
    key = os.path.realpath(directory)
    if key in _HELD:
        return
    os.makedirs(directory, exist_ok=True)
    path = lock_path(directory)
    # fallback_to_soft=False: a "soft" lock (a file that exists) would outlive a killed
    # job and lock the directory for good; an OS lock never does.
    lock = filelock.FileLock(path, thread_local=False, fallback_to_soft=False)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise CheckpointLockedError(f"{directory}: another job is using this checkpoint directory (it holds "
                                    f"the lock {path}); wait until it ends or use another directory") from None
    _HELD[key] = lock


def release(directory: str) -> None:
    """Release the lock of ``directory`` if this process holds it (else do nothing)."""
    lock = _HELD.pop(os.path.realpath(directory), None)
    if lock is not None:
        lock.release(force=True)


@contextlib.contextmanager
def held_or_free(directory: str) -> Iterator[bool]:
    """Yield True if this process holds the lock of ``directory`` during the block.

    Already held: True, and it stays held. Free: taken for the block and released
    after it; True. Held by another process (or it cannot be taken): False, nothing
    changes. ``directory`` must exist.
    """
    if holds(directory):
        yield True
        return
    lock = filelock.FileLock(lock_path(directory), thread_local=False, fallback_to_soft=False)
    try:
        lock.acquire(timeout=0)
    except OSError:  # filelock.Timeout included: another process holds it
        taken = False
    else:
        taken = True
    if not taken:
        yield False
        return
    try:
        yield True
    finally:
        lock.release(force=True)
