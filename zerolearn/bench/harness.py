"""Rounds: every system trains a few steps in each round, in turn, on the round's ranks.

Each round spawns ``world_size`` fresh ranks (:func:`zerolearn.dist.launch`) that train
every system one after the other, and the order rotates by one system from round to
round. So a change in the machine's load (other people's work on shared cores) hits
every system alike, no system always runs first or last, and the spread over rounds
shows how large that change was. Within a round the ranks are persistent: spawning
ranks and importing torch (and DeepSpeed) takes tens of seconds per launch on a few
busy cores, more than the steps themselves, so fresh ranks per system would make the
run mostly start-up. What a system could carry into the next one is kept out of its
numbers:

* the first ``warmup`` steps of every system (allocating the optimizer's state, first
  collectives, lazy initialisation) are not timed;
* the peak resident memory of a process only ever grows, so before each system the
  ranks drop what the previous one left (``gc``, glibc's ``malloc_trim``) and reset the
  kernel's high-water mark (``/proc/self/clear_refs``); each system's peak is then its
  own, the process's baseline (torch, the libraries) included and the RSS it started
  from recorded beside it;
* a library may replace torch's functions for the whole process (DeepSpeed's ZeRO-3
  puts its own ``torch.nn.functional.linear`` in place and leaves it there, which
  changes the last bits of every later model's gradients): every function of ``torch``, ``torch.nn.functional``,
  ``torch.distributed`` and ``torch.Tensor`` that a system replaced is put back after it
  (:func:`restore_torch`), and the result names them;
* one untimed step of ``zerolearn-0`` primes each rank before the first system;
* a system that raises is recorded with its error on that rank, which then stops its
  round; the launch's deadline and the process group's timeout bound every rank.

:func:`rank_job` is the rank side and serves the scaling sweeps as well.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
import time

import torch

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.bench import results
from zerolearn.bench.spec import BenchSpec
from zerolearn.bench.systems import build_system, count_params
from zerolearn.train import batch


def peak_rss_bytes() -> int:
    """This process's peak resident memory, bytes.

    Linux: ``VmHWM`` of ``/proc/self/status``, the peak of this process's own address
    space. ``getrusage``'s ``ru_maxrss`` (the fallback elsewhere) also holds the peak
    of the process that spawned this one (the kernel keeps it across ``exec``), so in
    a spawned rank it never reads below the launcher's own peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS: bytes; Linux, BSD: KiB


def reset_peak_rss() -> int | None:
    """Free what Python and the C allocator hold without use, then reset the kernel's
    peak-RSS mark to the current RSS (Linux); returns the RSS now (bytes), or None where
    the mark cannot be reset (then :func:`peak_rss_bytes` is the process's whole peak)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _namespaces() -> dict:
    import torch.distributed
    import torch.nn.functional

    return {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.distributed": torch.distributed,
            "torch.Tensor": torch.Tensor}


def torch_functions() -> dict[str, dict]:
    """Every callable attribute of ``torch``, ``torch.nn.functional``,
    ``torch.distributed`` and ``torch.Tensor`` now, by namespace and name."""
    return {ns: {k: v for k, v in list(vars(obj).items()) if callable(v)} for ns, obj in _namespaces().items()}


def restore_torch(saved: dict[str, dict]) -> list[str]:
    """Put back every function of ``saved`` (:func:`torch_functions`) that was replaced
    since; returns their names (``torch.nn.functional.linear``), sorted."""
    replaced = []
    for ns, obj in _namespaces().items():
        for name, value in list(vars(obj).items()):
            if name in saved[ns] and saved[ns][name] is not value:
                setattr(obj, name, saved[ns][name])
                replaced.append(f"{ns}.{name}")
    return sorted(replaced)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one(spec: BenchSpec, name: str) -> dict:
    """Train system ``name`` for ``warmup + steps`` steps on this rank; its measurements.

    Returns ``losses`` (global mean per step), ``seconds`` (this rank's wall time per
    step, forward to the end of the step, batch slicing and the loss's all_reduce left
    out), ``bytes`` (``grads`` after the first backward, ``params`` and
    ``optimizer_states`` after the last step), ``comm_elements`` (zerolearn: the
    paper's volume over all steps, Sec 7; None for systems whose collectives bypass
    :mod:`zerolearn.comm`) and ``cuda_peak_bytes`` (None on CPU).
    """
    ctx = zdist.context()
    config = spec.train_config()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    system = build_system(name, config)
    comm.LEDGER.reset()
    losses, seconds, grads = [], [], 0
    for step in range(spec.warmup + spec.steps):
        x, y = (data.rank_slice(t, ctx.rank, ctx.world_size).to(ctx.device) for t in batch(config, step))
        _sync(ctx.device)
        t0 = time.perf_counter()
        loss = system.forward_backward(x, y)
        if step == 0:  # a warm-up step, never timed
            grads = system.grad_bytes()
        system.step()
        local = loss.item()
        _sync(ctx.device)
        seconds.append(time.perf_counter() - t0)
        losses.append(comm.monitor_mean(local))
    held = system.state_bytes()
    out = {"losses": losses, "seconds": seconds,
           "bytes": {"params": held["params"], "grads": grads, "optimizer_states": held["optimizer_states"]},
           "comm_elements": comm.LEDGER.volume_elements() if name.startswith("zerolearn") else None,
           "cuda_peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None}
    del system
    gc.collect()
    return out


def rank_job(spec: BenchSpec, names: list[str], rounds: int = 1) -> dict[str, list[dict]]:
    """The rank side: ``rounds`` times every system of ``names`` in turn (the order
    rotating by one each round). Returns ``{name: [one result per round]}``, each a
    :func:`train_one` result with ``rss_before_bytes`` and ``peak_rss_bytes`` (this
    system's peak resident memory, bytes; see the module docstring) and ``replaced``
    (torch functions it replaced, put back since: :func:`restore_torch`) or, for a system
    that raised, ``{"error": message}``; nothing more runs on this rank after an error."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    # One untimed step first: what any system's first step on a fresh process loads
    # (gloo's buffers, kernels' scratch, the corpus) would otherwise count as the
    # memory of whichever system happens to run first.
    train_one(spec.replace(warmup=1, steps=1), "zerolearn-0")
    for r in range(rounds):
        for name in rotate(names, r):
            saved, before = torch_functions(), reset_peak_rss()
            try:
                result = train_one(spec, name)
            except Exception as e:  # noqa: BLE001 - reported in the result, the round stops here
                runs[name].append({"error": f"rank {zdist.context().rank}: {type(e).__name__}: {e}".strip()})
                return runs
            finally:
                replaced = restore_torch(saved)
            runs[name].append({**result, "rss_before_bytes": before, "peak_rss_bytes": peak_rss_bytes(),
                               "replaced": replaced})
    return runs


def rotate(names, r: int) -> list:
    """``names`` starting at position ``r`` (mod len): round r's order."""
    names = list(names)
    k = r % len(names)
    return names[k:] + names[:k]


def run_round(spec: BenchSpec, names: list[str], rounds: int = 1) -> list[dict]:
    """:func:`rank_job` on ``spec.world_size`` fresh ranks; one result per rank.

    The ranks get ``spec.timeout`` seconds per system and round (one more for the
    priming step); that is also their process group's timeout, so a rank stuck in a
    collective fails within it.

    Raises:
        zerolearn.dist.RankError: a rank died (a system that raises is recorded instead).
        TimeoutError: the ranks took longer than their deadline.
    """
    deadline = spec.timeout * (len(names) * rounds + 1)
    return zdist.launch(rank_job, spec.world_size, spec, list(names), rounds, timeout_s=deadline,
                        backend=spec.backend)


def run_bench(spec: BenchSpec, progress: bool = True) -> dict:
    """Every system of ``spec``, interleaved in ``spec.rounds`` rounds; the summary of
    :func:`zerolearn.bench.results.summarize` (a JSON-ready dict).

    A system that raises is recorded with its first error and left out of later rounds;
    a round whose ranks die or time out is recorded as a whole; the others go on.

    Raises:
        ConfigError: ``spec`` cannot run (:meth:`BenchSpec.check`), before any rank starts.
    """
    from tqdm.auto import tqdm

    spec.check()
    raw: dict[str, list[list[dict]]] = {name: [] for name in spec.systems}
    errors: dict[str, str] = {}
    for r in tqdm(range(spec.rounds), desc="bench", unit="round", disable=not progress):
        names = [n for n in rotate(spec.systems, r) if n not in errors]
        try:
            ranks = run_round(spec, names)
        except (zdist.RankError, TimeoutError) as e:
            for name in names:
                errors.setdefault(name, f"round {r}: " + (str(e).strip().splitlines() or [type(e).__name__])[0])
            continue
        for name in names:
            got = [rank[name][0] if rank[name] else None for rank in ranks]
            failed = [g["error"] for g in got if g is not None and "error" in g]
            if failed:
                errors[name] = failed[0]
            elif None not in got:
                raw[name].append(got)
    return results.summarize(spec, raw, errors, count_params(spec.train_config()))
