"""Ranks agree before they train: one configuration, one filesystem for checkpoints.

A torchrun job whose nodes were started with different options (another ``--seed``,
another ``--lr``) would otherwise train a blend of two configurations to a clean exit:
every collective still pairs up, only the numbers are wrong. So before the first
collective of training every rank hands the others its *fingerprint*: every option
that changes the numbers, the hash of the zerolearn source it runs and the torch
version; and checkpoints, which every rank writes and reads in one folder, need that
folder to be the same one on every node (a shared filesystem), which is checked with
a marker file that rank 0 writes and every rank must see.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

import torch

from zerolearn import comm
from zerolearn.errors import ConfigError

# Options that may differ between ranks: where rank 0 writes its report, progress bars.
PER_RANK_OPTIONS = ("report", "quiet")


@lru_cache(maxsize=1)
def code_version() -> str:
    """SHA-256 (first 12 hex digits) of every .py file of the installed zerolearn."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def fingerprint(config: dict) -> dict:
    """What must be equal on every rank: ``config`` less :data:`PER_RANK_OPTIONS`, the
    code version and the torch version."""
    same = {k: v for k, v in config.items() if k not in PER_RANK_OPTIONS}
    return {**same, "zerolearn source": code_version(), "torch": torch.__version__}


def check_same_config(config: dict, group=None) -> None:
    """Compare every rank's :func:`fingerprint` (one all_gather_object, not in the
    ledger). Raises ConfigError on every rank alike, naming the ranks and the options
    that differ, e.g. ``--seed: rank 0 has 0, ranks 2, 3 have 1``."""
    everyone = comm.gather_objects(fingerprint(config), group=group)
    differ = sorted({k for fp in everyone for k in fp if fp.get(k) != everyone[0].get(k)})
    if not differ:
        return
    lines = []
    for key in differ:
        by_value: dict[str, list[int]] = {}
        for rank, fp in enumerate(everyone):
            by_value.setdefault(repr(fp.get(key)), []).append(rank)
        sides = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} {'have' if len(r) > 1 else 'has'} "
                          f"{value}" for value, r in by_value.items())
        name = key if " " in key or key == "torch" else "--" + key.replace("_", "-")
        lines.append(f"{name}: {sides}")
    raise ConfigError("ranks were started with different configurations; every rank must run the same "
                      "options, code and torch:\n  " + "\n  ".join(lines))


def check_shared_dir(path: str, rank: int, group=None) -> None:
    """Rank 0 writes a marker file into ``path``; every rank must then see it.

    Raises ConfigError on every rank alike, naming the ranks that cannot see it (their
    ``path`` is another folder: checkpoints need a filesystem that all ranks share).
    """
    os.makedirs(path, exist_ok=True)
    marker = Path(path) / ".zerolearn-shared-marker"
    token = comm.gather_objects(os.urandom(8).hex() if rank == 0 else None, group=group)[0]
    if rank == 0:
        marker.write_text(token)
    comm.barrier(group)
    sees = marker.is_file() and marker.read_text() == token
    blind = [r for r, ok in enumerate(comm.gather_objects(sees, group=group)) if not ok]
    if blind:
        who = f"rank {blind[0]} does" if len(blind) == 1 else f"ranks {', '.join(map(str, blind))} do"
        raise ConfigError(f"--checkpoint-dir {path}: {who} not see the files rank 0 writes there; checkpoints "
                          "need a folder on a filesystem all ranks share")
