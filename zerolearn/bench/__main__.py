"""``python -m zerolearn.bench``: zerolearn's stages against DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed; ``python -m zerolearn.bench scaling``: the stages over world and model size.

    python -m zerolearn.bench --out bench.json              # 4 gloo ranks, every system
    python -m zerolearn.bench --quick --systems zerolearn,torch
    python -m zerolearn.bench --device cuda                 # 1 GPU, NCCL
    python -m zerolearn.bench scaling --out scaling.json

Exit codes: 0 done (a system that failed is marked in the table and the JSON); 2 bad
options, refused before any rank starts; 1 the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from zerolearn.bench.spec import QUICK, SYSTEMS, BenchSpec, parse_systems
from zerolearn.config import check_output_file
from zerolearn.errors import ConfigError

PROG = "python -m zerolearn.bench"
DESCRIPTION = ("zerolearn's stages 0-3 against torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed on the "
               "same GPT and batches; 'scaling' as the first argument runs the scaling sweeps instead.")


def add_spec_options(p: argparse.ArgumentParser, defaults: BenchSpec) -> None:
    """The flags of :class:`BenchSpec` (defaults shown in ``--help``)."""
    d = defaults
    p.add_argument("--world-size", type=int, default=None,
                   help=f"ranks (default {d.world_size} on CPU, 1 with --device cuda)")
    p.add_argument("--rounds", type=int, default=None, help=f"rounds over all systems (default {d.rounds})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps per round (default {d.warmup})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per round (default {d.steps})")
    p.add_argument("--width", "--d-model", type=int, default=None, dest="d_model",
                   help=f"GPT d_model (default {d.d_model})")
    p.add_argument("--layers", "--n-layer", type=int, default=None, dest="n_layer",
                   help=f"GPT blocks (default {d.n_layer})")
    p.add_argument("--heads", "--n-head", type=int, default=None, dest="n_head",
                   help=f"attention heads (default {d.n_head})")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--batch", "--global-batch-size", type=int, default=None, dest="global_batch_size",
                   help=f"global batch, sequences (default {d.global_batch_size})")
    p.add_argument("--lr", type=float, default=None, help=f"Adam's learning rate (default {d.lr:g})")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help=f"gradient bucket, MiB, for zerolearn, DDP and DeepSpeed (default {d.bucket_mb:g})")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one rank per GPU)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds each system may take per round; also the ranks' collective timeout "
                        f"(default {d.timeout:g})")
    p.add_argument("--quick", action="store_true",
                   help="a short run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", help="write the result here (JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def spec_from_args(args: argparse.Namespace, base: BenchSpec | None = None) -> BenchSpec:
    """``base`` (default :class:`BenchSpec`), then ``--quick``'s changes, then every flag given."""
    spec = base or BenchSpec()
    if args.quick:
        spec = spec.replace(**QUICK)
    given = {k: v for k, v in vars(args).items() if k in BenchSpec.__dataclass_fields__ and v is not None}
    if args.device == "cuda" and args.world_size is None:
        given["world_size"] = 1
    return spec.replace(**given)


def check_out(path: str | None) -> None:
    """Refuse an ``--out`` that cannot be written, before the run (ConfigError): a
    folder, a path ending in a separator, a missing or unreachable folder."""
    if path is None:
        return
    check_output_file("--out", path)


def write_json(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["scaling"]:
        from zerolearn.bench.scaling import main as scaling_main

        return scaling_main(argv[1:])
    from zerolearn.bench.harness import run_bench
    from zerolearn.bench.results import format_table

    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_spec_options(p, BenchSpec())
    p.add_argument("--systems", help="comma-separated: names (" + ", ".join(SYSTEMS) + ") or families "
                   "(zerolearn, torch, deepspeed); default every one, DeepSpeed's if it is installed")
    args = p.parse_args(argv)
    try:
        spec = spec_from_args(args).replace(systems=parse_systems(args.systems)).check()
        check_out(args.out)
    except ConfigError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    result = run_bench(spec, progress=not args.no_progress)
    print(format_table(result))
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
