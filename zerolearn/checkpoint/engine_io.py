"""Saving an engine's shards, and loading them into an engine of any stage and world size.

Both are collectives: call them on every rank of the engine's process group. What a
load reads, and how it re-cuts saved shards for this engine, is
:mod:`zerolearn.checkpoint.reshard`; this module runs the ranks through it together.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from zerolearn import comm, compat
from zerolearn.checkpoint.checksums import sha256_file, verify, verify_share
from zerolearn.checkpoint.files import (
    CheckpointError,
    CheckpointWriteError,
    complete,
    fsync_dir,
    rank_file,
    remove,
    step_dir,
    tmp_dir,
    write_atomic,
)
from zerolearn.checkpoint.lock import held_or_free
from zerolearn.checkpoint.manifest import FORMAT, VERSION
from zerolearn.checkpoint.reshard import cpu_copy, module_state, plan
from zerolearn.precision import DTYPES


def _whole_world(engine) -> None:
    # Under tensor parallelism (Nm > 1) several data-parallel groups would write files
    # of the same names holding different model slices: not supported (yet).
    if engine.world_size != torch.distributed.get_world_size():
        raise CheckpointError(f"the engine's process group has {engine.world_size} of "
                              f"{torch.distributed.get_world_size()} ranks (tensor parallelism?); "
                              "checkpoints support data parallelism over all ranks only")


def _split_state(engine, g) -> tuple[dict, dict]:
    """The optimizer's state of ``g.master``: (per-element tensors, scalars such as Adam's step)."""
    per, scalars = {}, {}
    for k, v in engine.optimizer.state.get(g.master, {}).items():
        if torch.is_tensor(v) and v.dim() > 0 and v.shape == g.master.shape:
            per[k] = cpu_copy(v)
        else:
            scalars[k] = cpu_copy(v) if torch.is_tensor(v) else v
    return per, scalars


def _identity(engine, rank: int, step: int) -> dict:
    """What a shard file belongs to (checksums.IDENTITY), recorded in it and in the manifest."""
    return {"rank": rank, "step": step, "world_size": engine.world_size, "stage": engine.stage,
            "dtype": next(k for k, v in DTYPES.items() if v == engine.dtype)}


def _payload(engine, step: int) -> dict:
    pieces = []
    # Stage 0 replicates everything (one shard): rank 0 alone writes it.
    for gi, g in enumerate(engine.buckets):
        if engine.rank >= g.layout.num_shards:
            continue
        per, scalars = _split_state(engine, g)
        start, stop = g.layout.shard_range
        pieces.append({"group": gi, "start": start, "stop": stop, "master": cpu_copy(g.master.float()),
                       "state": per, "scalars": scalars})
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    out = {"format": FORMAT, "version": VERSION, **_identity(engine, engine.rank, step), "pieces": pieces,
           "rng": rng}
    if engine.rank == 0:
        out["module"] = module_state(engine)[1]
    return out


def _write(engine, step: int, path: str) -> dict:
    """Write this rank's file; what the manifest needs to know of it."""
    # Offload: no DPU step in flight, and disk's optimizer states read in while they are saved.
    resident = getattr(engine, "offload_resident", None)
    with resident() if resident is not None else contextlib.nullcontext():
        payload = _payload(engine, step)
        size = write_atomic(path, lambda f: torch.save(payload, f))
    return {"bytes": size, "sha256": sha256_file(path),
            "pieces": [[p["group"], p["start"], p["stop"]] for p in payload["pieces"]],
            "state_keys": sorted({k for p in payload["pieces"] for k in p["state"]})}


def save(engine, directory: str, step: int, extra: dict | None = None, keep: int | None = None) -> str:
    """Write ``engine``'s training state as checkpoint ``step`` under ``directory``.

    Each rank writes its own shards into a temporary folder; rank 0 adds the manifest
    and renames the folder to ``step_NNNNNNNN`` only when every rank's file is
    complete, so a crash during the save leaves the previous checkpoints as they were.
    A checkpoint of the same step is replaced. Collective (call on every rank).

    Args:
        step: steps completed; a resumed run starts at this step.
        extra: JSON-serialisable data stored in the manifest (e.g. the run's config).
        keep: keep only the newest ``keep`` complete checkpoints (None: all); older
            ones are removed only after the new one verifies (sizes and SHA-256 of
            every shard, read back from disk by rank 0).

    Leftovers of saves that crashed (``.step_*.tmp``, ``step_*.old``) are removed
    first, but only while this process holds the directory's lock
    (:mod:`zerolearn.checkpoint.lock`) or can take it for that moment: never while
    another job holds it (it may be writing them).

    Returns: the checkpoint's path.

    Raises:
        CheckpointWriteError: on every rank, if any rank failed to write (a full disk:
            OSError ENOSPC, or any other error; the message names the rank and the
            path), or the new checkpoint did not verify when read back (then it is
            removed). The previous checkpoints stay intact.
        CheckpointError: the engine's group is not the whole world.
    """
    _whole_world(engine)
    tmp, final = tmp_dir(directory, step), step_dir(directory, step)
    problem = _prepare(directory, tmp) if engine.rank == 0 else None
    # Rank 0 has made the folder (or failed to): the others may write now (or give up).
    problem = comm.gather_objects(problem, engine.pg)[0]
    if problem is not None:
        raise CheckpointWriteError(f"checkpoint {final} not written: {problem}")
    meta = {"rank": engine.rank, "file": rank_file(engine.rank), "error": None}
    path = os.path.join(tmp, meta["file"])
    try:
        meta.update(_write(engine, step, path))
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        meta["error"] = f"writing {path}: {type(e).__name__}: {e}"
    metas = comm.gather_objects(meta, engine.pg)
    status = _finish(engine, directory, step, extra, keep, metas) if engine.rank == 0 else None
    status = comm.gather_objects(status, engine.pg)[0]
    if status is not None:
        raise CheckpointWriteError(f"checkpoint {final} not written: {status}")
    return final


def _prepare(directory: str, tmp: str) -> str | None:
    """Rank 0: remove what crashed saves left (only under the lock) and make ``tmp``;
    the error message, or None."""
    try:
        os.makedirs(directory, exist_ok=True)
        with held_or_free(directory) as mine:
            for name in os.listdir(directory) if mine else []:  # leftovers of saves that crashed
                if (name.startswith(".step_") and name.endswith(".tmp")
                        or name.startswith("step_") and name.endswith(".old")):
                    remove(os.path.join(directory, name))
        os.makedirs(tmp)
    except OSError as e:
        return f"rank 0: {type(e).__name__}: {e}"
    return None


def _manifest(engine, step: int, extra: dict | None, metas: list[dict]) -> dict:
    """The manifest (format in :mod:`zerolearn.checkpoint`) of a save whose ranks wrote ``metas``."""
    groups = [{"names": list(g.layout.names), "shapes": [list(s) for s in g.layout.shapes],
               "offsets": list(g.layout.offsets), "numel": g.layout.numel,
               "padded_numel": g.layout.padded_numel, "pieces": []} for g in engine.buckets]
    for m in metas:
        for index, (gi, start, stop) in enumerate(m["pieces"]):
            groups[gi]["pieces"].append([m["rank"], start, stop, index])
    aliases, module = module_state(engine, copy=False)
    return {
        "format": FORMAT, "version": VERSION, "step": step, "stage": engine.stage,
        "world_size": engine.world_size, "optimizer": engine.optimizer_name,
        "dtype": _identity(engine, 0, step)["dtype"], "torch": compat.TORCH_VERSION,
        "scaler": {"enabled": engine.scaler.enabled, **engine.scaler.state_dict()},
        "params": [[n, list(s)] for g in engine.buckets for n, s in zip(g.layout.names, g.layout.shapes, strict=True)],
        "skipped": {n: k for g in engine.buckets for n, k in zip(g.layout.names, g.skipped, strict=True) if k},
        "state_keys": metas[0]["state_keys"], "groups": groups, "aliases": aliases,
        "module_keys": sorted(module),
        "files": [{"file": m["file"], "bytes": m["bytes"], "sha256": m["sha256"],
                   **_identity(engine, m["rank"], step)} for m in metas],
        "extra": extra or {}}


def _commit(directory: str, tmp: str, final: str, keep: int | None) -> str | None:
    """Rank 0: rename ``tmp`` to ``final``, verify it from disk, then prune; the error, or None.

    Only a checkpoint that verifies replaces the same step's earlier one or prunes others.
    """
    if os.path.exists(final):  # same step saved again (e.g. after a restart)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    fsync_dir(directory)
    try:  # read back from disk
        verify(final)
    except CheckpointError as e:
        remove(final)
        if os.path.exists(final + ".old"):
            os.replace(final + ".old", final)
        return f"rank 0: it did not verify when read back, older checkpoints kept: {e}"
    remove(final + ".old")
    for _, old in complete(directory)[:-keep] if keep else []:
        remove(old)
    return None


def _finish(engine, directory, step, extra, keep, metas) -> str | None:
    """Rank 0: write the manifest and rename the folder; the error message, or None."""
    tmp, final = tmp_dir(directory, step), step_dir(directory, step)
    failed = [f"rank {m['rank']}: {m['error']}" for m in metas if m["error"]]
    if failed:
        remove(tmp)
        return "; ".join(failed)
    where = tmp  # what rank 0 is writing, for the message if it fails
    try:
        manifest = _manifest(engine, step, extra, metas)
        where = os.path.join(tmp, "manifest.json")
        write_atomic(where, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        fsync_dir(tmp)
        where = final
        return _commit(directory, tmp, final, keep)
    except Exception as e:  # noqa: BLE001
        remove(tmp)  # a partial save (frees the space a full disk needs)
        if not os.path.exists(final) and os.path.exists(final + ".old"):
            with contextlib.suppress(OSError):  # the others wait for this rank's answer
                os.replace(final + ".old", final)  # the same step's earlier checkpoint, as it was
        return f"rank 0: writing {where}: {type(e).__name__}: {e}"


def _agree(engine, problem: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank has a ``problem``."""
    problems = comm.gather_objects(problem, engine.pg) if engine.world_size > 1 else [problem]
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        if len({p for _, p in bad}) == 1:
            raise CheckpointError(f"cannot load the checkpoint: {bad[0][1]}")
        raise CheckpointError("cannot load the checkpoint: " + "; ".join(f"rank {r}: {p}" for r, p in bad))


@torch.no_grad()
def load(engine, path: str, restore_rng: bool = True, verify_files: bool = True) -> int:
    """Load checkpoint ``path`` (or the newest under it) into ``engine``; return its step.

    The checkpoint may come from any stage and world size: for each parameter of
    ``engine``, its saved elements (fp32 master, optimizer moments) are found in
    whichever rank files hold them, and this rank's new shard is cut out. The loss
    scale is restored when both runs use fp16, random states when the world size is
    the same (each rank its own). Collective (call on every rank).

    With ``verify_files`` (default) every shard file is first checked against the
    manifest's size and SHA-256 (the ranks share the hashing: each file is read once);
    False checks sizes only (for a checkpoint verified just before, e.g. by
    :func:`zerolearn.checkpoint.resume`). A checkpoint saved without checksums
    loads after its sizes are checked (see :mod:`zerolearn.checkpoint.checksums`).

    Raises:
        CheckpointError: on every rank, if any rank finds the checkpoint missing,
            damaged (the file named, with what differs from the manifest), from
            another model or optimizer, or unmappable. Raised before anything
            changes: the engine is untouched.
    """
    _whole_world(engine)
    if verify_files:
        _agree(engine, verify_share(path, engine.rank, engine.world_size))
    found, problem = None, None
    try:
        found = plan(engine, path)
    except CheckpointError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
        problem = f"{type(e).__name__}: {e}"
    _agree(engine, problem)
    _apply(engine, found, restore_rng)
    return found["step"]


def _apply(engine, found: dict, restore_rng: bool) -> None:
    """Set what :func:`zerolearn.checkpoint.reshard.plan` found (a collective: republishes)."""
    engine.load_shards(found["masters"], found["optimizer"])
    man = found["manifest"]
    for g in engine.buckets:  # steps each parameter sat out, unused on every rank (Adam counts them)
        g.skipped = [man.skipped.get(n, 0) for n in g.layout.names]
    if man.scaler.enabled and engine.scaler.enabled:
        engine.scaler.load_state_dict(man.scaler.state_dict())
    if "module" in found:
        mine = engine.model.state_dict(keep_vars=True)
        for k, t in found["module"].items():
            mine[k].copy_(t)
    if restore_rng and found["rng"] is not None:
        torch.set_rng_state(found["rng"]["torch"])
        if found["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(found["rng"]["cuda"])
