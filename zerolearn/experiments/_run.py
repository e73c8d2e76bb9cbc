"""Shared body of the chapter scripts: train one stage, print the per-rank table."""

from __future__ import annotations

import os
import sys

from zerolearn import dist as zdist
from zerolearn.config import TrainConfig, build_parser
from zerolearn.dist import ConfigError
from zerolearn.experiments.machine import plan_chapter
from zerolearn.report import format_rank_table
from zerolearn.train import train_here


def run_chapter(stage: int, title: str, argv: list[str] | None = None) -> int:
    """Parse train options (``--stage`` fixed to ``stage``), train, print on rank 0."""
    script = ("dp", "zero1", "zero2", "zero3")[stage]
    parser = build_parser(f"torchrun --nproc-per-node N -m zerolearn.experiments.{script}")
    try:
        config = TrainConfig(**{**vars(parser.parse_args(argv)), "stage": stage})
        env = zdist.torchrun_env()
        # Fewer GPUs than ranks on this node: gloo ranks on the CPU, said once (plan_chapter).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env[1] if env else 1))
        backend, device, note = plan_chapter(local, config.backend, config.device)
        config = config.replace(backend=backend, device=device)
        config.validate(env[1] if env else 1)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if note and (env is None or env[0] == 0):
        print(f"{title}: {note}", flush=True)
    report = train_here(config, progress=not config.quiet)
    if env is None or env[0] == 0:  # rank 0 prints
        print(f"\n{title}: {report['config']['model']}, Psi = {report['num_params']:,}, "
              f"{report['world_size']} {report['backend']} rank(s) on {report['device']}, "
              f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}\n")
        print(format_rank_table(report))
    return 0


def main(stage: int, title: str) -> None:
    sys.exit(run_chapter(stage, title))
