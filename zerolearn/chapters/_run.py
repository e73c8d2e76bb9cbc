"""Shared body of the chapter scripts: train one stage, print the per-rank table."""

from __future__ import annotations

import sys

from zerolearn import dist as zdist
from zerolearn.dist import ConfigError
from zerolearn.report import format_rank_table
from zerolearn.train import build_parser, train, validate


def run_chapter(stage: int, title: str, argv: list[str] | None = None) -> int:
    """Parse train options (``--stage`` fixed to ``stage``), train, print on rank 0."""
    parser = build_parser()
    parser.prog = f"torchrun --nproc-per-node N -m zerolearn.chapters.{title.split()[0].lower()}"
    args = parser.parse_args(argv)
    args.stage = stage
    try:
        env = zdist.torchrun_env()
        validate(args, env[1] if env else 1)
        ctx = zdist.init(args.backend, args.device, args.timeout)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        report = train(args, progress=not args.quiet)
    except BaseException:
        zdist.teardown(clean=False)
        raise
    zdist.teardown()
    if ctx.rank == 0:
        print(f"\n{title}: {report['config']['model']}, Psi = {report['num_params']:,}, "
              f"{report['world_size']} {report['backend']} rank(s) on {report['device']}, "
              f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}\n")
        print(format_rank_table(report))
    return 0


def main(stage: int, title: str) -> None:
    sys.exit(run_chapter(stage, title))
