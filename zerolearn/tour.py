"""The tour: one small GPT trained on real text under DP, ZeRO-1, ZeRO-2 and ZeRO-3.

    make tour            (or: python -m zerolearn.tour [--world-size 4] [--steps 20])

Four gloo ranks on this machine's CPU (NCCL, one rank per GPU, when it has two GPUs or
more; one GPU cannot show partitions, so a one-GPU machine runs the four gloo ranks
too and says so: :func:`zerolearn.experiments.machine.plan_tour`) train the same
byte-level GPT on CPython's Language Reference, once per stage, with the same seed
and the same global batches. The table shows, for rank 0, the bytes it holds per
category next to the paper's formula (Sec 5, Fig 1) and the
data its collectives moved per step in units of Psi next to Sec 7's 2 Psi / 3 Psi.
The losses agree across stages: ZeRO changes where state lives, not the maths.
"""

from __future__ import annotations

import argparse
import sys

from tqdm.auto import tqdm

from zerolearn.config import TrainConfig
from zerolearn.dist import ConfigError, launch
from zerolearn.errors import require_count
from zerolearn.experiments.machine import plan_tour
from zerolearn.report import format_table, stage_row
from zerolearn.train import train


def run_tour(world_size: int, steps: int, backend: str, config: TrainConfig | None = None,
             show_progress: bool = True) -> tuple[list[dict], list[dict]]:
    """Train every stage of ``config`` (default: :class:`TrainConfig`'s defaults) on
    ``world_size`` spawned ranks for ``steps`` steps; return (reports, table rows)."""
    config = config or TrainConfig()
    reports, rows = [], []
    stages = tqdm(range(4), desc="tour", unit="stage", disable=not show_progress)
    for stage in stages:
        stages.set_postfix(stage=stage)
        report = launch(train, world_size, config.replace(stage=stage, steps=steps, quiet=True), backend=backend)[0]
        reports.append(report)
        rows.append(stage_row(report))
    return reports, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolearn.tour", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: one per GPU with 2 or more GPUs, else 4 gloo ranks on the CPU)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: nccl with at least 2 GPUs (and as many as ranks), else gloo; "
                        "--backend nccl --world-size 1 trains one NCCL rank on one GPU")
    args, extra = p.parse_known_args(argv)
    config = TrainConfig.from_argv(extra)  # exits 2 naming a bad training option
    try:  # everything the ranks would refuse, refused here before any rank starts
        plan = plan_tour(args.world_size, args.backend)
        args.world_size, args.backend = plan.world_size, plan.backend
        require_count("--world-size", args.world_size)
        config.replace(steps=args.steps, backend=args.backend).validate(args.world_size)
    except ConfigError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"tour: {plan.note}")
    try:
        reports, rows = run_tour(args.world_size, args.steps, args.backend, config)
    except ConfigError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    r0 = reports[0]
    cfg = r0["config"]
    print(f"\n{cfg['model']} with Psi = {r0['num_params']:,} parameters, {cfg['dtype']} {cfg['optimizer']}, "
          f"{args.steps} steps of {cfg['global_batch_size']} x {cfg['seq_len']} bytes, "
          f"{r0['world_size']} {r0['backend']} ranks on {r0['device']}; bytes held by rank 0:\n")
    print(format_table(rows))
    spread = max(max(abs(a - b) for a, b in zip(r["losses"], r0["losses"], strict=True)) for r in reports)
    pad = max(r["padding"] for r in rows)
    print(f"\nlargest loss difference between stages over all steps: {spread:.2e}")
    print(f"measured - formula: flat buffers are padded so Nd shards are equal ({pad} zero elements "
          f"here); the optimizer row leaves out Adam's scalar step counters.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
