"""The seed experiment, done right: the blog's MLP under DP and ZeRO-1/2/3, measured.

    python -m zerolearn.experiments.seed_experiment                # 2 gloo ranks, width 1024
    python -m zerolearn.experiments.seed_experiment --width 10000  # full size (GPU, ~9.6 GB of model states per rank)
    python -m zerolearn.experiments.seed_experiment --simulate-world-size 2
    torchrun --nproc-per-node 2 -m zerolearn.experiments.seed_experiment --width 10000

The blog reproduction this book starts from trained 6 square Linear layers of width
10,000 with Adam at batch 16 on 2 GPUs and found ZeRO-2's peak memory *above*
ZeRO-1's. That came from its implementation, not from ZeRO: it built each
reduce-scatter input by concatenating the whole gradient world-size times and kept
full gradients around. Here the same job runs on the engines of this package (flat
buckets reduce-scattered during backward and freed at once), and the peak of
ZeRO-2 comes out below ZeRO-1's, as Sec 5.2 says it must.

The default width (1024) fits a laptop's memory; the full width needs about
16 x 600M bytes of model states per rank under DP.
"""

from __future__ import annotations

import argparse
import sys

import torch

from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.dist import ConfigError, launch
from zerolearn.report import CATEGORIES, stage_row
from zerolearn.tables import text_table
from zerolearn.train import train, train_here


def job_config(args: argparse.Namespace, stage: int) -> TrainConfig:
    """The seed experiment's run at ``stage``: an MLP of ``args.layers`` x ``args.width``, Adam."""
    return TrainConfig(stage=stage, model="mlp", mlp_width=args.width, mlp_layers=args.layers,
                       global_batch_size=args.batch, steps=args.steps, dtype=args.dtype, optimizer="adam",
                       bucket_mb=args.bucket_mb, quiet=True, simulate_world_size=args.simulate_world_size or None)


def run_all(args: argparse.Namespace) -> list[dict]:
    """One report per stage: in this process group under torchrun or simulation, else spawned ranks."""
    if zdist.torchrun_env() is not None or args.simulate_world_size:
        return [train_here(job_config(args, stage)) for stage in range(4)]
    backend = "nccl" if torch.cuda.is_available() and args.world_size <= torch.cuda.device_count() else "gloo"
    return [launch(train, args.world_size, job_config(args, s), backend=backend)[0] for s in range(4)]


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
    p.add_argument("--world-size", type=int, default=2, help="spawned ranks when not under torchrun")
    p.add_argument("--simulate-world-size", type=int, default=None, metavar="N")
    args = p.parse_args(argv)
    try:
        reports = run_all(args)
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


if __name__ == "__main__":
    sys.exit(main())
