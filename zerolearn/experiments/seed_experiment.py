"""The seed experiment, done right: the blog's MLP under DP and ZeRO-1/2/3, measured.

    python -m zerolearn.experiments.seed_experiment                # CPU: 2 gloo ranks, width 1024
    python -m zerolearn.experiments.seed_experiment                # 1 GPU: 2 simulated ranks, width 10,000
    python -m zerolearn.experiments.seed_experiment --simulate-world-size 8 [--one-process]
    torchrun --nproc-per-node 2 -m zerolearn.experiments.seed_experiment --width 10000

The blog reproduction this book starts from trained 6 square Linear layers of width
10,000 with Adam at batch 16 on 2 GPUs and found ZeRO-2's peak memory *above*
ZeRO-1's. That came from its implementation, not from ZeRO: it built each
reduce-scatter input by concatenating the whole gradient world-size times and kept
full gradients around. Here the same job runs on the engines of this package (flat
buckets reduce-scattered during backward and freed at once), and the peak of
ZeRO-2 comes out below ZeRO-1's, as Sec 5.2 says it must.

The default width (1024) fits a laptop's memory; the full width (the default on a
GPU) needs about 16 x 600M bytes of model states per rank under DP. With fewer GPUs than
ranks the ranks are simulated on the one GPU (:func:`zerolearn.experiments.machine.plan_seed`;
every shard and buffer has its size on N ranks, collectives move no data), and each
stage runs in a fresh process, so that a stage's peak is its own (``--one-process``
runs the four in this process). The first line printed says which. :func:`gpu_table`
gives the full-width measurement stored from an H200 beside the blog's numbers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

import torch

from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.dist import ConfigError, launch
from zerolearn.experiments.machine import RankPlan, plan_seed
from zerolearn.report import CATEGORIES, stage_row
from zerolearn.tables import text_table
from zerolearn.train import train, train_here


def job_config(args: argparse.Namespace, stage: int) -> TrainConfig:
    """The seed experiment's run at ``stage``: an MLP of ``args.layers`` x ``args.width``, Adam."""
    return TrainConfig(stage=stage, model="mlp", mlp_width=args.width, mlp_layers=args.layers,
                       global_batch_size=args.batch, steps=args.steps, dtype=args.dtype, optimizer="adam",
                       bucket_mb=args.bucket_mb, quiet=True, simulate_world_size=args.simulate_world_size or None)


def plan(args: argparse.Namespace) -> RankPlan:
    """Where the stages run (:func:`zerolearn.experiments.machine.plan_seed`) for ``args``."""
    return plan_seed(args.world_size, args.simulate_world_size, zdist.torchrun_env() is not None)


def _one_stage(config: TrainConfig, queue) -> None:
    """A fresh process's stage: train it, put its report (or the error) on ``queue``."""
    try:
        queue.put((True, train_here(config)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        queue.put((False, f"{type(e).__name__}: {e}"))


def in_fresh_process(config: TrainConfig) -> dict:
    """``train_here(config)`` in a new process (``spawn``), so that nothing of an earlier
    stage is in its memory: its peak is its own. Returns the report.

    Raises:
        RuntimeError: the run failed (its message) or the process died without a report.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_one_stage, args=(config, queue), daemon=True)
    proc.start()
    proc.join()
    if queue.empty():
        raise RuntimeError(f"stage {config.stage}: its process exited with code {proc.exitcode} and no report")
    ok, value = queue.get()
    if not ok:
        raise RuntimeError(f"stage {config.stage}: {value}")
    return value


def run_all(args: argparse.Namespace, where: RankPlan | None = None) -> list[dict]:
    """One report per stage: in this process group under torchrun; a simulated world one
    stage per fresh process (all four in this one with ``args.one_process``); else
    spawned ranks (NCCL with enough GPUs, else gloo on the CPU)."""
    where = where or plan(args)
    if zdist.torchrun_env() is not None:
        return [train_here(job_config(args, stage)) for stage in range(4)]
    if where.simulated:
        configs = [job_config(args, stage).replace(simulate_world_size=where.world_size, device=where.device)
                   for stage in range(4)]
        if getattr(args, "one_process", False):
            return [train_here(c) for c in configs]
        return [in_fresh_process(c) for c in configs]
    return [launch(train, where.world_size, job_config(args, s), backend=where.backend)[0] for s in range(4)]


def format_seed_table(reports: list[dict]) -> str:
    """One row per stage: MiB held on rank 0 (measured and by formula), its peak, Psi moved per step."""
    header = ["stage", "params MiB\nmeasured", "\nformula", "grads MiB\nmeasured", "\nformula",
              "optim MiB\nmeasured", "\nformula", "peak MiB\nmeasured", "Psi/step\nmeasured"]
    rows = []
    for report in reports:
        r = stage_row(report)
        rows.append([f"{r['stage']} {r['name']}",
                     *(f"{r[k] / 2**20:.2f}" for c in CATEGORIES for k in (c, c + "_formula")),
                     f"{r['peak_bytes'] / 2**20:.2f}", f"{r['psi_per_step']:.3f}"])
    return text_table(header, rows, align=["left", *["right"] * (len(header) - 1)])


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m zerolearn.experiments.seed_experiment",
                                description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=10_000 if gpu else 1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=16, help="global batch (the blog's: 16)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket, MiB (a layer at width 1024)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks when not under torchrun (default 2: NCCL with 2 GPUs, simulated on 1, gloo without)")
    p.add_argument("--simulate-world-size", type=int, default=None, metavar="N")
    p.add_argument("--one-process", action="store_true",
                   help="simulated ranks: the four stages in this process, not one fresh process each")
    args = p.parse_args(argv)
    try:
        where = plan(args)
        env = zdist.torchrun_env()
        if env is None or env[0] == 0:
            how = ("" if not where.simulated else
                   ", the four stages in this process" if args.one_process else ", each stage in a fresh process")
            print(f"seed experiment: {where.note}{how}", flush=True)
        reports = run_all(args, where)
    except ConfigError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    r0, env = reports[0], zdist.torchrun_env()
    if env is None or env[0] == 0:
        peak_source = "CUDA allocator" if r0["device"] == "cuda" else "ledger, last step"
        print(f"\nMLP {args.layers} x Linear({args.width}, {args.width}), Psi = {r0['num_params']:,}, "
              f"Adam, {args.dtype}, batch {args.batch}, {r0['world_size']} {r0['backend']} ranks "
              f"on {r0['device']}; rank 0 (peak: {peak_source})\n")
        print(format_seed_table(reports))
        peaks = [r["ranks"][0]["peak_bytes"] for r in reports]
        verdict = "below" if peaks[2] < peaks[1] else "NOT below"
        print(f"\nZeRO-2's peak ({peaks[2] / 2**20:.2f} MiB) is {verdict} ZeRO-1's ({peaks[1] / 2**20:.2f} MiB).")
    return 0


GPU_JSON = Path(__file__).resolve().parents[2] / "notebooks" / "data" / "gpu" / "seed_experiment_h200.json"
"""The full-width seed experiment measured on one H200, one stage per process (the book's stored figures)."""


def gpu_table(path: str | Path | None = None) -> list[dict]:
    """The stored full-width GPU measurement beside the blog's numbers, one row per stage.

    Reads ``path`` (default :data:`GPU_JSON`, written from a run of this experiment at
    width 10,000 with 2 simulated ranks, each stage in a fresh process). Each row:
    ``stage`` (0-3), ``name``, ``peak_MiB`` (rank 0's peak, ``torch.cuda.max_memory_allocated``,
    MiB), ``params_MiB``, ``grads_MiB``, ``optimizer_states_MiB`` (what rank 0 holds
    between steps, MiB), ``blog_peak_MB`` (the blog's reported peak, MB as it printed
    them), and ``device`` (e.g. "NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9").

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not the seed experiment's measurement (names the missing key).
    """
    path = Path(path) if path is not None else GPU_JSON
    data = json.loads(path.read_text())
    for key in ("device", "stages", "blog_peak_MB"):
        if key not in data:
            raise ValueError(f"{path}: not a stored seed-experiment measurement (no {key!r})")
    env = data["device"]
    label = f"{env['name']}, torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}"
    return [{"stage": s["stage"], "name": s["name"], "peak_MiB": s["peak_MiB"], "params_MiB": s["params_MiB"],
             "grads_MiB": s["grads_MiB"], "optimizer_states_MiB": s["optimizer_states_MiB"],
             "blog_peak_MB": data["blog_peak_MB"][s["stage"]], "device": label}
            for s in data["stages"]]


if __name__ == "__main__":
    sys.exit(main())
