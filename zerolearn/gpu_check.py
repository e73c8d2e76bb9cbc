"""The whole GPU check in one call: every stage on NCCL with CUDA memory statistics.

    python -m zerolearn.gpu_check --out gpu          (or: make gpu-check)

Runs the tour's job for stages 0-3 at world size 1 on NCCL (one process, one GPU:
NCCL cannot put two ranks on one GPU), in fp32 and bf16, on the small GPT and on
the seed experiment's MLP at a larger width, and writes each report
(``peak_bytes`` from ``torch.cuda.max_memory_allocated``) to ``OUT/`` with a
summary table. With more GPUs it also runs the tour on all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from zerolearn import dist as zdist
from zerolearn.report import format_rank_table
from zerolearn.train import build_parser, train

JOBS = {
    "gpt-fp32": ["--model", "gpt", "--dtype", "fp32"],
    "gpt-bf16": ["--model", "gpt", "--dtype", "bf16"],
    "mlp4096-bf16": ["--model", "mlp", "--mlp-width", "4096", "--dtype", "bf16", "--bucket-mb", "16"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolearn.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu", help="folder for the reports")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.exit(2, f"{p.prog}: error: CUDA is not available on this machine\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(zdist.free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    zdist.init("nccl", "cuda")
    summary = [f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
               f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"]
    try:
        for name, extra in JOBS.items():
            for stage in range(4):
                run = build_parser().parse_args(["--stage", str(stage), "--steps", str(args.steps),
                                                 "--quiet", "--backend", "nccl", "--device", "cuda", *extra])
                torch.cuda.empty_cache()
                report = train(run)
                (out / f"{name}-stage{stage}.json").write_text(json.dumps(report, indent=1))
                summary += [f"\n{name} stage {stage}: loss {report['losses'][0]:.4f} -> "
                            f"{report['losses'][-1]:.4f}, {report['step_seconds_median'] * 1e3:.2f} ms/step",
                            format_rank_table(report)]
    finally:
        zdist.teardown()
    text = "\n".join(summary)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    if torch.cuda.device_count() > 1:
        from zerolearn.tour import main as tour
        tour(["--backend", "nccl", "--world-size", str(torch.cuda.device_count())])
    return 0


if __name__ == "__main__":
    sys.exit(main())
