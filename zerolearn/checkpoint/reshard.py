"""Resharding: cut this rank's new shards out of a checkpoint saved at any stage and Nd.

A saved shard is a range of elements of a flat group's buffer, and the manifest
records every group's layout (names, shapes, offsets). So the elements of any
parameter can be found again, whichever stage and world size saved them, and laid
into this engine's layout (:class:`zerolearn.flat.FlatLayout`): for each of this
rank's groups, each parameter's overlap with the rank's shard range is read from
whichever saved pieces hold it (paper Sec 5's element-wise partitioning is what makes
this a few lines of arithmetic). Nothing here communicates or changes the engine.
"""

from __future__ import annotations

import torch

from zerolearn.checkpoint.files import CheckpointError, Reader, read_manifest, resolve


def module_state(engine, copy: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(tied name -> saved name, frozen parameters and buffers by name) of the model.

    ``copy``: the frozen tensors as CPU copies (to save), or the model's own (to compare).
    """
    trainable = {id(p): n for g in engine.buckets for n, p in zip(g.layout.names, g.params, strict=True)}
    aliases, module = {}, {}
    for key, t in engine.model.state_dict(keep_vars=True).items():
        if id(t) in trainable:
            if trainable[id(t)] != key:
                aliases[key] = trainable[id(t)]
        else:
            module[key] = cpu_copy(t) if copy else t
    return aliases, module


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, owning exactly its elements (torch.save writes whole storages)."""
    t = t.detach().cpu()
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def _same(a: dict, b: dict) -> bool:
    def plain(d):
        return {k: v.tolist() if torch.is_tensor(v) else v for k, v in d.items()}
    return plain(a) == plain(b)


def check_model(engine, man, path: str) -> None:
    """Refuse a checkpoint of another model (names, shapes, frozen tensors) or optimizer.

    Raises:
        CheckpointError: naming what differs (first five names of each kind).
    """
    mine = {n: list(s) for g in engine.buckets for n, s in zip(g.layout.names, g.layout.shapes, strict=True)}
    theirs = {n: list(s) for n, s in man.params}
    problems = [f"{n}: checkpoint {theirs[n]}, this model {s}" for n, s in mine.items()
                if n in theirs and theirs[n] != s]
    for what, names in (("missing from the checkpoint", [n for n in mine if n not in theirs]),
                        ("not in this model", [n for n in theirs if n not in mine])):
        if names:
            problems.append(f"{what}: {', '.join(names[:5])}{' ...' * (len(names) > 5)}")
    module = set(module_state(engine, copy=False)[1])
    if module != set(man.module_keys):
        problems.append(f"frozen parameters and buffers differ: checkpoint {sorted(man.module_keys)}, "
                        f"this model {sorted(module)}")
    if problems:
        raise CheckpointError(f"{path} was saved from another model: " + "; ".join(problems))
    if man.optimizer != engine.optimizer_name:
        raise CheckpointError(f"{path} holds {man.optimizer} state; this engine uses {engine.optimizer_name}")


def _read_group(reader: Reader, g, state_keys: tuple[str, ...], path: str) -> tuple[torch.Tensor, dict]:
    """This rank's shard of group ``g``: (fp32 master, optimizer state for it or {}).

    Raises:
        CheckpointError: the saved groups it draws from disagree on scalar state
            (e.g. Adam's step), which a single merged master cannot hold.
    """
    a, b = g.layout.shard_range  # the part of g's flat buffer this rank's master holds
    master = torch.zeros(b - a)
    per = {k: torch.zeros(b - a) for k in state_keys}
    old = set()
    for n, o in zip(g.layout.names, g.layout.offsets, strict=True):
        group, offset, numel = reader.where[n]
        old.add(group)
        lo, hi = max(a, o), min(b, o + numel)
        if lo < hi:  # the saved elements [lo, hi) of n, wherever they are now
            for key, out in (("master", master), *per.items()):
                reader.read(group, offset + lo - o, offset + hi - o, key, out[lo - a:hi - a])
    scalars = [reader.scalars(group) for group in sorted(old)]
    if any(not _same(s, scalars[0]) for s in scalars):
        raise CheckpointError(f"{path}: saved groups disagree on the optimizer's {scalars}; cannot merge")
    if not (per or scalars[0]):
        return master, {}
    # Copies: torch.optim steps its scalar state in place (Adam's step += 1), so two
    # groups must never share one tensor, nor write into the mapped file.
    return master, {**{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars[0].items()}, **per}


def plan(engine, path: str) -> dict:
    """Everything a load will set, read and checked, without touching the engine.

    Returns: ``{"step", "masters" (one fp32 tensor per group, shaped as its master),
    "optimizer" (a state dict for ``engine.optimizer``), "manifest", "rng" (this rank's
    random states, or None when the world size differs), "module" (frozen tensors,
    if any)}``.

    Raises:
        CheckpointError: missing, damaged or unmappable checkpoint, or one of another
            model or optimizer.
    """
    path = resolve(path)
    man = read_manifest(path)
    check_model(engine, man, path)
    reader = Reader(man, hashed=True)  # the bytes loaded are the bytes hashed
    masters, state = [], {}
    for j, g in enumerate(engine.buckets):
        master, group_state = _read_group(reader, g, man.state_keys, path)
        masters.append(master)
        if group_state:
            state[j] = group_state
    optimizer = engine.optimizer.shard_state_dict()
    optimizer["state"] = state
    out = {"step": man.step, "masters": masters, "optimizer": optimizer, "manifest": man, "rng": None}
    if man.module_keys:
        out["module"] = reader.file(0)["module"]
        mine = engine.model.state_dict(keep_vars=True)
        for k, t in out["module"].items():
            if t.shape != mine[k].shape:
                raise CheckpointError(f"{path} was saved from another model: {k}: checkpoint "
                                      f"{list(t.shape)}, this model {list(mine[k].shape)}")
    if man.world_size == engine.world_size:  # each rank gets its own random state back
        out["rng"] = reader.file(engine.rank)["rng"]
    return out
