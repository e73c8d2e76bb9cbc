"""The whole GPU check in one call: every stage on NCCL with CUDA memory statistics.

    python -m zerolearn.gpu_check --out gpu          (or: make gpu-check)

Runs the tour's job for stages 0-3 at world size 1 on NCCL (one process, one GPU:
NCCL cannot put two ranks on one GPU), in fp32 and bf16, on the small GPT and on
the seed experiment's MLP at a larger width, and writes each report
(``peak_bytes`` from ``torch.cuda.max_memory_allocated``) to ``OUT/`` with a
summary table; the bf16 GPT at stage 3 also leaves a CUDA memory snapshot
(``--cuda-memory-snapshot``). Then MD (Sec 6.3) from torch's own allocator statistics
(``defrag.cuda_memory`` without and with MD, ``OUT/md.json``). With more GPUs it
also runs the tour on all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from zerolearn import dist as zdist
from zerolearn.config import TrainConfig
from zerolearn.report import format_rank_table
from zerolearn.residual import defrag
from zerolearn.tables import text_table
from zerolearn.train import train

JOBS = {
    "gpt-fp32": TrainConfig(model="gpt", dtype="fp32"),
    "gpt-bf16": TrainConfig(model="gpt", dtype="bf16"),
    "mlp4096-bf16": TrainConfig(model="mlp", mlp_width=4096, dtype="bf16", bucket_mb=16),
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
        for name, job in JOBS.items():
            for stage in range(4):
                # One run also leaves torch's memory snapshot (pytorch.org/memory_viz): ZeRO-3's sawtooth.
                snap = str(out / f"{name}-stage{stage}-snapshot.pickle") if (name, stage) == ("gpt-bf16", 3) else None
                run = job.replace(stage=stage, steps=args.steps, quiet=True, backend="nccl", device="cuda",
                                  cuda_memory_snapshot=snap)
                torch.cuda.empty_cache()
                report = train(run)
                (out / f"{name}-stage{stage}.json").write_text(json.dumps(report, indent=1))
                summary += [f"\n{name} stage {stage}: loss {report['losses'][0]:.4f} -> "
                            f"{report['losses'][-1]:.4f}, {report['step_seconds_median'] * 1e3:.2f} ms/step",
                            format_rank_table(report)]
    finally:
        zdist.teardown()
    summary += ["", md_summary(out)]
    text = "\n".join(summary)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    if torch.cuda.device_count() > 1:
        from zerolearn.tour import main as tour
        tour(["--backend", "nccl", "--world-size", str(torch.cuda.device_count())])
    return 0


def md_summary(out: Path) -> str:
    """MD (Sec 6.3) on the device: ``defrag.cuda_memory`` without and with MD, written
    to ``OUT/md.json``; torch's own statistics of reserved, allocated and inactive-split
    bytes for the steps that the CPU chapters replay through the allocator model."""
    runs = {"without MD": defrag.cuda_memory(md=False), "with MD": defrag.cuda_memory(md=True)}
    (out / "md.json").write_text(json.dumps(runs, indent=1))
    mib = 2**20
    rows = [[name, f"{r['allocated_peak'] / mib:.0f}", f"{r['reserved_peak'] / mib:.0f}",
             f"{r['inactive_split_peak'] / mib:.0f}", f"{r['fragmentation']:.1%}", r["alloc_retries"]]
            for name, r in runs.items()]
    return ("MD on CUDA (defrag.FRAGMENTING_GPT, 2 steps): MiB at the peaks\n"
            + text_table(["", "allocated", "reserved", "inactive split", "unused", "retries"], rows,
                         align=["left", *["right"] * 5]))


if __name__ == "__main__":
    sys.exit(main())
