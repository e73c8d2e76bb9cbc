"""``python -m zerolearn.bench``: zerolearn's stages against DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed; ``python -m zerolearn.bench scaling``: the stages over world and model size.

    python -m zerolearn.bench --out bench.json              # 4 gloo ranks, every system
    python -m zerolearn.bench --widths 128,384 --overhead   # two model sizes, and the cost at world size 1
    python -m zerolearn.bench --quick --systems zerolearn,torch
    python -m zerolearn.bench --device cuda                 # 1 GPU, NCCL
    python -m zerolearn.bench scaling --out scaling.json

Exit codes: 0 done (a system that failed is marked in the table and the JSON); 2 bad
options, refused before any rank starts; 1 the run itself failed.
"""

from __future__ import annotations

import argparse
import sys

from zerolearn.bench.results import write_json
from zerolearn.bench.spec import (
    PROG,
    SYSTEMS,
    ZEROLEARN,
    BenchSpec,
    add_spec_options,
    check_out,
    parse_systems,
    spec_from_args,
)
from zerolearn.errors import ConfigError

DESCRIPTION = ("zerolearn's stages 0-3 against torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed on the "
               "same GPT and batches; 'scaling' as the first argument runs the scaling sweeps instead.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["scaling"]:
        from zerolearn.bench.scaling import main as scaling_main

        return scaling_main(argv[1:])
    from zerolearn.bench.harness import run_bench
    from zerolearn.bench.results import format_overhead, format_table, overhead_at_world_size_1

    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_spec_options(p, BenchSpec())
    p.add_argument("--systems", help="comma-separated: names (" + ", ".join(SYSTEMS) + ") or families "
                   "(zerolearn, torch, deepspeed); default every one, DeepSpeed's if it is installed")
    p.add_argument("--widths", help="comma-separated d_model values: the comparison at each (the first is the "
                   "JSON's main result, the others under 'more_widths')")
    p.add_argument("--overhead", action="store_true",
                   help="also time zerolearn's stages against DDP at world size 1 (under 'overhead_ws1')")
    args = p.parse_args(argv)
    try:
        spec = spec_from_args(args).replace(systems=parse_systems(args.systems)).check()
        widths = [spec.d_model] if args.widths is None else [int(w) for w in args.widths.split(",")]
        specs = [spec.replace(d_model=w).check() for w in widths]
        check_out(args.out)
    except ValueError as e:  # ConfigError, or a width that is not a number
        p.exit(2, f"{p.prog}: error: {e if isinstance(e, ConfigError) else f'--widths {args.widths!r}: {e}'}\n")
    results = []
    for s in specs:
        results.append(run_bench(s, progress=not args.no_progress))
        print(format_table(results[-1]), end="\n\n")
    result = {**results[0], "more_widths": results[1:]} if len(results) > 1 else results[0]
    if args.overhead:
        one = run_bench(specs[0].replace(world_size=1, systems=(*ZEROLEARN, "ddp")), progress=not args.no_progress)
        result["overhead_ws1"] = overhead_at_world_size_1(one)
        print(format_overhead(result["overhead_ws1"]))
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
