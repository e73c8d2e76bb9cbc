"""Sharded checkpoints that lose nothing, load at any stage and world size, and survive crashes.

    save(engine, "ckpt", step)          # every rank: its shards, plus rank 0's manifest
    step = load(engine, "ckpt")         # every rank: newest complete checkpoint, resharded
    python -m zerolearn.checkpoint consolidate ckpt model.pt   # one fp32 state_dict

Each rank saves exactly what it owns (paper Sec 5): its shard of every flat group's
fp32 master and of the optimizer's per-element state (Adam's ``exp_avg`` and
``exp_avg_sq``, SGD's ``momentum_buffer``). Because a shard is a range of elements of
a flat buffer whose layout (names, shapes, offsets) is in the manifest, the elements
of any parameter can be found again whatever stage and world size saved them, and
re-cut for any other: that is resharding (N ranks -> M ranks, stage S -> S').

Directory format (version 1)::

    DIR/step_00000040/            one complete checkpoint, after 40 steps
        manifest.json             written last, by rank 0
        rank_00000.pt ...         one torch.save file per rank of the saving job
    DIR/.step_00000050.tmp/       a save in progress, or one that crashed (ignored)

``manifest.json``: ``format`` ("zerolearn-checkpoint"), ``version``, ``step`` (steps
completed), ``stage``, ``world_size``, ``dtype``, ``optimizer``, ``torch``;
``scaler`` (fp16 loss scale: ``enabled``, ``scale``, ``clean_steps``,
``skipped_steps``); ``params``: [name, shape] of every trainable parameter;
``skipped`` ({name: steps} of parameters that sat out optimizer steps, unused on
every rank, so that Adam's per-parameter step count survives a resume; optional);
``groups``: per flat group ``names``, ``shapes``, ``offsets`` (elements),
``numel``, ``padded_numel`` and ``pieces``: [rank, start, stop, index], meaning
elements [start, stop) of the group's flat buffer are piece ``index`` of that
rank's file; ``state_keys``: the per-element optimizer states saved; ``aliases``
(tied state_dict names -> saved name); ``module_keys`` (frozen parameters and
buffers, saved whole by rank 0); ``files``: [{file, bytes, sha256, rank, step,
world_size, stage, dtype}]: each shard file's size, SHA-256 and what it belongs to;
``extra`` (the caller's, e.g. the run's config).

``rank_RRRRR.pt`` (``torch.load(..., weights_only=True)``): ``pieces``: a list of
{``group``, ``start``, ``stop``, ``master`` (fp32, stop - start elements),
``state`` {name: fp32 tensor of the same size}, ``scalars`` (e.g. Adam's ``step``)};
``rng`` ({``torch``, ``cuda``} random states of that rank); rank 0 also ``module``;
and ``rank``, ``step``, ``world_size``, ``stage``, ``dtype`` as in the manifest.
At stage 0 every rank holds the same state, so only rank 0 writes pieces.

Crash safety: ranks write into ``.step_N.tmp`` (each file as ``.part``, fsynced, then
renamed); after all report success, rank 0 writes the manifest and renames the folder
to ``step_N`` (an atomic rename on one file system). A crash at any moment leaves the
earlier checkpoints untouched; :func:`latest` only sees renamed folders. Older
checkpoints are pruned (``keep``) only after the new one verifies, re-read from disk.

One job per directory (:mod:`zerolearn.checkpoint.lock`): ``DIR/.lock`` is an OS file
lock that ``python -m zerolearn.train --checkpoint-dir DIR`` holds (rank 0) for its
whole run; a second job on DIR is refused before training
(:class:`CheckpointLockedError`, exit 2). Leftover ``.step_*.tmp`` folders are removed
only by a process that holds the lock, so never while a live job writes them.

Write failures (a full disk, any OSError, a checkpoint that does not verify when read
back) raise :class:`CheckpointWriteError`, a runtime error (exit 1), naming the rank
and the path; bad or damaged input raises :class:`CheckpointError` (exit 2).

Corruption (:mod:`zerolearn.checkpoint.checksums`): every shard is checked against the
manifest's size and SHA-256 before it is trusted: by :func:`load`, by :func:`resume`
(which falls back to the newest checkpoint that verifies, saying so), and by
``python -m zerolearn.checkpoint info`` and ``consolidate`` (exit 2, naming the file
and what differs: damaged, truncated, another rank's, another step's). Checkpoints
saved before checksums were recorded still load, with a note that only sizes were
checked.

The manifest has one schema (:class:`zerolearn.checkpoint.manifest.Manifest`), checked
whole before anything uses it: every field's type and range, every piece index, and
every field that can be checked against another (the step against the folder's name
and each shard's recorded owner, each shard's file name against its rank, the offsets,
sizes and pieces against the layout the shapes imply); a problem names the file and
the field (``manifest.json: groups[0].offsets[0]: 1, but the shapes before it imply
0``). Each shard file is then checked against it when read (its owner, each piece's
group, range and tensors).

Loading validates everything first (manifest, every file present with its recorded
size and SHA-256, names and shapes against the model, the optimizer), on every rank,
and agrees across ranks before any parameter changes; then each rank reads the files
holding pieces that overlap its new shards, hashing the very bytes it loads (read
once into memory, checked, and ``torch.load`` from them). ``consolidate`` verifies
every file, then streams them memory-mapped, and refuses an output inside a
checkpoint directory.

Why not ``torch.distributed.checkpoint`` (DCP)? DCP reshards tensors whose
placement it knows (DTensor, ShardedTensor). Our shards are ranges of a padded flat
buffer that cut across parameters (Sec 5's element-wise partitioning), which DCP
cannot describe without first re-expressing every shard per parameter; the manifest
above records exactly that mapping in a few lines of JSON, readable without torch.
"""

import os
import sys

import torch

from zerolearn import comm
from zerolearn.checkpoint.checksums import NO_CHECKSUMS, choose, verify
from zerolearn.checkpoint.engine_io import load, save
from zerolearn.checkpoint.files import (
    CheckpointError,
    CheckpointWriteError,
    Reader,
    check_out,
    latest,
    read_full,
    read_manifest,
    resolve,
    write_atomic,
)
from zerolearn.checkpoint.lock import CheckpointLockedError
from zerolearn.checkpoint.manifest import Manifest, ManifestError
from zerolearn.errors import ConfigError


def manifest(path: str) -> Manifest:
    """The checked manifest of checkpoint ``path`` (or of the newest one under it).

    Raises:
        CheckpointError: no checkpoint there, or its manifest does not fit the schema
            (:class:`zerolearn.checkpoint.manifest.Manifest`: the file and field named).
    """
    return read_manifest(resolve(path))


def consolidate(path: str, out: str) -> dict[str, torch.Tensor]:
    """Write the full-precision ``state_dict`` of the model saved in ``path`` to ``out``.

    The result loads with ``model.load_state_dict(torch.load(out), strict=True)`` into
    the plain ``nn.Module``: trainable parameters in fp32 from the masters, tied
    names included, plus frozen parameters and buffers as rank 0 held them (floating
    ones as fp32). Every shard is first verified against the manifest (size and
    SHA-256 of the file that is then read; see :mod:`zerolearn.checkpoint.checksums`).
    ``out`` may not lie inside any checkpoint directory (:func:`files.check_out`). Written
    to ``out.part`` and renamed when complete; on any failure no ``out.part`` is
    left. Returns it.

    Raises:
        CheckpointError: ``out`` is refused; a shard does not verify (named, with
            what differs); see :func:`files.read_full`.
        OSError: ``out`` cannot be written.
    """
    check_out(out, (path,))
    path = resolve(path)
    check_out(out, (path,))
    man = read_manifest(path, check_files=False)
    verify(path, man)
    state = read_full(path, "master")
    for key, name in man.aliases.items():
        state[key] = state[name]
    if man.module_keys:
        module = Reader(man).file(0)["module"]
        for key in man.module_keys:
            t = module[key]
            state[key] = t.float().clone() if t.is_floating_point() else t.clone()
    write_atomic(out, lambda f: torch.save(state, f))
    return state


def _say(line: str) -> None:
    """One line to stderr in one write (lines of several ranks never interleave)."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def _decide(directory: str) -> tuple:
    """Rank 0's choice of checkpoint: ("none",), ("load", path, note or None) or ("fail", message)."""
    try:
        path, note, skipped = choose(directory)
    except CheckpointError as e:
        return ("fail", str(e))
    except Exception as e:  # noqa: BLE001 - the other ranks must hear of it, or they hang
        return ("fail", f"{directory}: {type(e).__name__}: {e}")
    if path is None:
        return ("none",)
    if skipped:
        (newest, why), more = skipped[0], f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        fallback = f"checkpoint {newest}{more} fails verification, resuming from {path} instead: {why}"
        note = fallback if note is None else f"{fallback} ({NO_CHECKSUMS})"
    return ("load", path, note)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def compare_options(saved: dict, config: dict, must_match: tuple[str, ...],
                    may_change: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(options of ``must_match`` that differ, options of ``may_change`` that differ),
    each as ``--flag VALUE (the checkpoint's run: VALUE)``, between a checkpoint's saved
    config and this run's ``config`` (both by field name). Keys the saving run did not
    record are not compared."""
    def differ(keys):
        return [f"{_flag(k)} {config.get(k)} (the checkpoint's run: {saved[k]})"
                for k in keys if k in saved and saved[k] != config.get(k)]
    return differ(must_match), differ(may_change)


def resume(engine, directory: str | None, config: dict, must_match: tuple[str, ...] = (),
           may_change: tuple[str, ...] = ()) -> int:
    """Load the newest complete checkpoint under ``directory`` that verifies into ``engine``.

    Returns the step to start at: the checkpoint's, or 0 when ``directory`` is None or
    holds no complete checkpoint. ``config`` is saved as ``extra["config"]`` by the
    training loop; the keys in ``must_match`` (the data and every option that shapes
    the model) must equal the saving run's; those in ``may_change`` (options of the
    optimisation, such as weight decay and clipping) may differ, and rank 0 prints one
    line naming each change. A collective (call on every rank).

    Rank 0 alone checks the checkpoints, newest first, against their manifests
    (schema, sizes, SHA-256, the shards' contents;
    :func:`zerolearn.checkpoint.checksums.choose`) and tells the others which to load.
    If the newest fails, whatever the damage, the newest one that verifies is loaded
    instead and rank 0 prints one line to stderr naming both (and why the newest
    failed); a checkpoint saved without checksums loads with a line saying so.

    Raises:
        ConfigError: a key of ``must_match`` differs (named, with both values).
        CheckpointError: complete checkpoints exist but none verifies (each named
            with what differs); or see :func:`load` (nothing loaded).
    """
    if not directory:
        return 0
    decision = _decide(directory) if engine.rank == 0 else None
    if engine.world_size > 1:
        decision = comm.gather_objects(decision, engine.pg)[0]  # rank 0 decides, the others follow
    if decision[0] == "none":
        return 0
    if decision[0] == "fail":
        raise CheckpointError(f"cannot resume: {decision[1]}")
    path, note = decision[1], decision[2]
    if note and engine.rank == 0:
        _say(note)
    saved = manifest(path).extra.get("config", {})
    if not isinstance(saved, dict):
        raise ManifestError(f"{os.path.join(path, 'manifest.json')}: extra.config: must be an object")
    differ, changed = compare_options(saved, config, must_match, may_change)
    if differ:
        raise ConfigError(f"{directory} holds a checkpoint of a run with other options: this run has "
                          + ", ".join(differ) + "; resume with the same options or use another directory")
    if changed and engine.rank == 0:
        _say(f"resuming from {path} with changed options: " + ", ".join(changed))
    return load(engine, path, verify_files=False)  # rank 0 has just verified every file


__all__ = ["CheckpointError", "CheckpointLockedError", "CheckpointWriteError", "Manifest", "ManifestError", "choose",
           "compare_options", "consolidate", "latest", "load", "manifest", "read_full", "resume", "save", "verify"]
