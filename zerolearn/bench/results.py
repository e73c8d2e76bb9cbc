"""From the ranks' measurements to the benchmark's result (JSON) and its table.

Everything the table prints is read from the result dict :func:`summarize` returns,
so the stored JSON reproduces the printed table exactly (:func:`format_table`).

Units: seconds and bytes in data; milliseconds and MiB (2**20 bytes) only in the table.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
from pathlib import Path

import torch

from zerolearn.bench.spec import PEERS, STAGE, BenchSpec
from zerolearn.memory import model as analytic
from zerolearn.tables import text_table

LOSS_ATOL = 1e-5
"""Largest difference between two systems' losses at any step that still counts as
equal: fp32 sums over ranks taken in another order (buckets, rings, shards) differ in
the last bits, and Adam carries that on (about 1e-6 after a few steps here)."""

CATEGORIES = ("params", "grads", "optimizer_states")


def step_stats(seconds: list[float]) -> dict[str, float]:
    """Median, quartiles, min and max of step times (seconds); quartiles by the
    inclusive method (q1 = q3 = the value for a single step)."""
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else seconds * 3
    return {"median_s": statistics.median(seconds), "q1_s": q1, "q3_s": q3, "min_s": min(seconds),
            "max_s": max(seconds)}


def formula_bytes(psi: int, nd: int, stage: int) -> dict[str, int | float]:
    """The paper's model-state bytes per rank for fp32 Adam (Sec 5, Fig 1, with 4 + 4 + 8
    bytes per parameter for params, grads and optimizer states in place of 2 + 2 + K)."""
    states = analytic.model_state_bytes(psi, nd, stage, k=8, param_bytes=4, grad_bytes=4)
    return {c: states[c] for c in CATEGORIES}


def summarize_system(spec: BenchSpec, rounds: list[list[dict]]) -> dict:
    """One system's rounds (per round, one dict per rank from
    :func:`zerolearn.bench.harness.rank_job`) as its entry of the result.

    Per rank: ``bytes`` (the same every round), ``peak_rss_bytes`` and
    ``peak_rss_above_start_bytes`` (the least over rounds: the ranks are shared within a
    round, and what ran before a system, DeepSpeed's import say, raises the baseline it
    starts from) and ``cuda_peak_bytes`` (the most over rounds; None on CPU)."""
    # A step ends for the job when its slowest rank is done.
    per_round = [[max(rank["seconds"][i] for rank in ranks) for i in range(spec.warmup, spec.warmup + spec.steps)]
                 for ranks in rounds]
    measured = [s for r in per_round for s in r]
    losses = [ranks[0]["losses"] for ranks in rounds]
    spread = max(abs(a - b) for lo in losses for a, b in zip(lo, losses[0], strict=True))
    world = len(rounds[0])
    return {"stage": None, "step_seconds": measured, **step_stats(measured),
            "round_medians_s": [statistics.median(r) for r in per_round],
            "losses": losses[0], "loss_round_spread": spread,
            "replaced_torch_functions": sorted({f for ranks in rounds for rank in ranks
                                                for f in rank.get("replaced", [])}),
            "comm_elements_per_step": (rounds[0][0]["comm_elements"] / (spec.warmup + spec.steps)
                                       if rounds[0][0]["comm_elements"] is not None else None),
            "ranks": [{"rank": r, "bytes": rounds[0][r]["bytes"],
                       "peak_rss_bytes": min(ranks[r]["peak_rss_bytes"] for ranks in rounds),
                       "peak_rss_above_start_bytes": _above_start(ranks[r] for ranks in rounds),
                       "cuda_peak_bytes": _most(ranks[r]["cuda_peak_bytes"] for ranks in rounds)}
                      for r in range(world)]}


def _most(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _above_start(runs) -> int | None:
    """How far a system's peak RSS rose above the RSS it started from, the least over
    rounds (bytes); None where the kernel's peak mark could not be reset."""
    rises = [r["peak_rss_bytes"] - r["rss_before_bytes"] for r in runs if r["rss_before_bytes"] is not None]
    return min(rises) if rises else None


def compare_losses(systems: dict[str, dict]) -> str | None:
    """Mark every system's ``loss_max_abs_diff`` against the reference (zerolearn's first
    stage that ran, else the first system) and ``losses_equal`` (within :data:`LOSS_ATOL`
    of the reference at every step, and from round to round); return the reference's name."""
    ran = [n for n, s in systems.items() if "losses" in s]
    if not ran:
        return None
    ref = next((n for n in ran if n.startswith("zerolearn")), ran[0])
    for name in ran:
        diff = max(abs(a - b) for a, b in zip(systems[name]["losses"], systems[ref]["losses"], strict=True))
        systems[name]["loss_max_abs_diff"] = diff
        systems[name]["losses_equal"] = diff <= LOSS_ATOL and systems[name]["loss_round_spread"] <= LOSS_ATOL
    return ref


def add_ratios(systems: dict[str, dict]) -> None:
    """For each zerolearn stage S: ``ratio_to_best_peer`` = its median step time over the
    fastest median among the peers of stage S that ran (:data:`~zerolearn.bench.spec.PEERS`),
    and ``best_peer``; None when no peer ran."""
    for name, entry in systems.items():
        if not name.startswith("zerolearn") or "median_s" not in entry:
            continue
        peers = [p for p in PEERS[STAGE[name]] if "median_s" in systems.get(p, {})]
        best = min(peers, key=lambda p: systems[p]["median_s"]) if peers else None
        entry["best_peer"] = best
        entry["ratio_to_best_peer"] = entry["median_s"] / systems[best]["median_s"] if best else None


def summarize(spec: BenchSpec, raw: dict[str, list[list[dict]]], errors: dict[str, str], psi: int) -> dict:
    """The benchmark's result: the spec, versions, Psi, the formula's bytes per stage and,
    per system, step-time statistics (seconds), losses and their check, bytes per rank,
    peak memory, the ratio to the best peer, or the error that stopped it."""
    systems: dict[str, dict] = {}
    for name in spec.systems:
        entry = summarize_system(spec, raw[name]) if raw.get(name) else {}
        if name in errors:
            entry["error"] = errors[name]
        entry["stage"] = STAGE[name]
        systems[name] = entry
    reference = compare_losses(systems)
    add_ratios(systems)
    return {"spec": spec.as_dict(), "world_size": spec.world_size, "device": spec.device,
            "backend": spec.backend, "torch": torch.__version__, "deepspeed": _deepspeed_version(spec),
            "cpu": platform.processor() or platform.machine(), "accelerator": accelerator(spec.device),
            "commit": commit(), "psi": psi, "loss_atol": LOSS_ATOL, "loss_reference": reference,
            "formula_bytes": {str(s): formula_bytes(psi, spec.world_size, s) for s in range(4)},
            "systems": systems}


def commit() -> str | None:
    """The package's git commit (short hash) when it runs from a clone, else None."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def accelerator(device: str) -> dict | None:
    """On ``device == "cuda"``: the GPU's name and count, CUDA's and NCCL's versions (what a
    GPU table must state beside its times); None on the CPU."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}


def _deepspeed_version(spec: BenchSpec) -> str | None:
    if not any(n.startswith("deepspeed") for n in spec.systems):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


# ----- the table -------------------------------------------------------------------------
HEADER = ["system", "stage", "step ms\nmedian", "IQR\nms", "min-max\nms", "vs best peer\n(median)", "losses",
          "params\nbytes", "grads\nbytes", "optimizer\nbytes", "peak RSS\nMiB", "RSS rise\nMiB"]
CUDA_HEADER = "CUDA peak\nMiB"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def header(result: dict) -> list[str]:
    """The table's columns: :data:`HEADER`, and the CUDA peak on CUDA."""
    return HEADER + ([CUDA_HEADER] if result["device"] == "cuda" else [])


def _ms(seconds: float) -> str:
    """Milliseconds to 3 significant digits, without an exponent."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def table_rows(result: dict) -> list[list]:
    """One row per system, every cell from ``result``. Bytes: the most any rank holds
    (ZeroRedundancyOptimizer's whole-tensor shards differ per rank); peak RSS and its
    rise over the RSS the system started from: the most of any rank (each rank's the
    least over rounds, :func:`summarize_system`)."""
    rows = []
    for name, s in result["systems"].items():
        if "median_s" not in s:
            rows.append([name, s["stage"], f"failed: {s.get('error', 'no result')}"[:60]])
            continue
        ratio = (f"{s['ratio_to_best_peer']:.2f}x {s['best_peer']}" if s.get("ratio_to_best_peer") is not None
                 else "-")
        check = "equal" if s["losses_equal"] else f"DIFFER {s['loss_max_abs_diff']:.1e}"
        most = {c: max(r["bytes"][c] for r in s["ranks"]) for c in CATEGORIES}
        ranks = s["ranks"]
        rows.append([name, s["stage"], _ms(s["median_s"]), _ms(s["q3_s"] - s["q1_s"]),
                     f"{_ms(s['min_s'])}-{_ms(s['max_s'])}", ratio, check, most["params"], most["grads"],
                     most["optimizer_states"], _mib(_most(r["peak_rss_bytes"] for r in ranks)),
                     _mib(_most(r["peak_rss_above_start_bytes"] for r in ranks))]
                    + ([_mib(_most(r["cuda_peak_bytes"] for r in ranks))] if result["device"] == "cuda" else []))
    return rows


def format_table(result: dict) -> str:
    """The printed table, with a header line (job) and a footer (formula bytes, loss check)."""
    spec = result["spec"]
    head = (f"GPT d_model {spec['d_model']}, {spec['n_layer']} layers, Psi = {result['psi']:,}; "
            f"{result['world_size']} {result['backend']} ranks on {result['device']}; fp32 Adam lr {spec['lr']:g}; "
            f"{spec['rounds']} rounds x ({spec['warmup']} warm-up + {spec['steps']} timed steps), "
            f"global batch {spec['global_batch_size']} x {spec['seq_len']}")
    formula = ", ".join(f"stage {s}: " + " + ".join(f"{b[c]:,.0f}" for c in CATEGORIES)
                        for s, b in result["formula_bytes"].items())
    foot = [f"Sec 5's bytes per rank in fp32, params + grads + optimizer (the paper counts mixed precision, "
            f"K = 12, Sec 3.1; fp32 Adam's 4 + 4 + 8 is the book's adaptation): {formula}",
            f"losses: every step within {result['loss_atol']:g} of {result['loss_reference']}'s; "
            "bytes: the most any rank holds; peak RSS: the most of any rank (the least over rounds), the "
            "process's baseline (torch, libraries) included; RSS rise: peak minus the RSS the system started from"]
    replaced = {n: s["replaced_torch_functions"] for n, s in result["systems"].items()
                if s.get("replaced_torch_functions")}
    foot += [f"{n} replaced {', '.join(f)} for the whole process (put back after it)" for n, f in replaced.items()]
    cols = header(result)
    return "\n".join([head, "", text_table(cols, table_rows(result), align=["left"] + ["right"] * (len(cols) - 1)),
                      "", *foot])


SUMMARY_HEADER = ["system", "stage", "step ms\nmedian", "IQR\nms", "vs best peer\n(median)", "losses",
                  "peak MiB"]


def summary(result: dict) -> dict:
    """The seven columns of a comparison that fit a page (:data:`SUMMARY_HEADER`: system,
    stage, step-time median and IQR in ms, ratio to the best peer, the loss check and the
    peak memory of the busiest rank, MiB: CUDA's on a GPU, RSS on the CPU) and the job's
    line, from a full result of :func:`summarize`. A result that already is a summary (the
    stored GPU measurement, ``notebooks/data/bench/gpu.json``, has no per-step times) is
    returned as it is.

    Returns:
        ``{"job": str, "device": str, "accelerator": dict | None, "torch": str,
        "rows": [[str, int, str, str, str, str, str], ...]}``.
    """
    if "rows" in result:
        return result
    head = format_table(result).split("\n", 1)[0]
    cuda = result["device"] == "cuda"
    rows = []
    for row in table_rows(result):
        if len(row) < len(HEADER):  # a failed system: name, stage, the error
            rows.append(row + [""] * (len(SUMMARY_HEADER) - len(row)))
        else:
            rows.append([row[0], row[1], row[2], row[3], row[5], row[6], row[-1] if cuda else row[10]])
    return {"job": head, "device": result["device"], "accelerator": result.get("accelerator"),
            "torch": result["torch"], "measured": f"at commit {result['commit']}" if result.get("commit") else None,
            "rows": rows}


def format_summary(result: dict) -> str:
    """:func:`summary` as a printed table under its job line, then the machine's line."""
    s = summary(result)
    gpu = s.get("accelerator")
    machine = (f"{gpu['count']} x {gpu['name']}, torch {s['torch']}, CUDA {gpu['cuda']}, NCCL {gpu['nccl']}"
               if gpu else f"torch {s['torch']} on the CPU")
    peak = "CUDA peak" if s["device"] == "cuda" else "peak RSS"
    table = text_table([h.replace("peak MiB", f"{peak}\nMiB") for h in SUMMARY_HEADER], s["rows"],
                       align=["left"] + ["right"] * (len(SUMMARY_HEADER) - 1))
    lines = [s["job"], "", table, "", machine + (f"; {s['measured']}" if s.get("measured") else "")]
    return "\n".join(lines)


OVERHEAD_GOALS = {0: None, 1: 0.10, 2: 0.10, 3: 0.25}  # most overhead over DDP at world size 1, per stage


def overhead_at_world_size_1(result: dict) -> dict[str, dict]:
    """Per zerolearn stage that ran, at world size 1: ``{"median_s", "ddp_median_s",
    "overhead"}``, where overhead is the stage's median step time over DDP's, minus 1
    (0.05: 5% slower), and ``goal`` its bound (:data:`OVERHEAD_GOALS`, None for stage 0).

    Raises:
        ValueError: ``result`` did not run at world size 1 or DDP did not run.
    """
    if result["world_size"] != 1 or "median_s" not in result["systems"].get("ddp", {}):
        raise ValueError("the overhead needs a world-size-1 result with DDP in it")
    ddp = result["systems"]["ddp"]["median_s"]
    return {name: {"median_s": entry["median_s"], "ddp_median_s": ddp, "overhead": entry["median_s"] / ddp - 1,
                   "goal": OVERHEAD_GOALS[entry["stage"]]}
            for name, entry in result["systems"].items() if name.startswith("zerolearn") and "median_s" in entry}


def format_overhead(overhead: dict[str, dict]) -> str:
    """One line per stage: step ms at world size 1 against DDP's, the overhead and its goal."""
    lines = ["overhead against torch DDP at world size 1 (the engine's own cost, no communication to hide it):"]
    for name, o in overhead.items():
        goal = "" if o["goal"] is None else f" (goal < {o['goal']:.0%})"
        lines.append(f"  {name}: {o['median_s'] * 1e3:.1f} ms vs DDP {o['ddp_median_s'] * 1e3:.1f} ms: "
                     f"{o['overhead']:+.0%}{goal}")
    return "\n".join(lines)


def write_json(result: dict, path: str | None) -> None:
    """Write ``result`` to ``path`` as indented JSON (nothing when ``path`` is None).

    Raises:
        OSError: ``path`` cannot be written.
    """
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
