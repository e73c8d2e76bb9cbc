"""``python -m zerolearn.timeline --out DIR``: record the chapters' timelines and store them as JSON.

Writes ``stages.json``, ``bucket_sweep.json`` and ``prefetch.json`` into DIR (times in
seconds) and prints one line per recording; ``--traces DIR`` also keeps the profiler's
Chrome trace of each recording and rank. Exit codes: 0 success, 2 bad arguments
(before anything is recorded: counts out of range, a DIR that is a file or cannot be
reached or written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from zerolearn import timeline
from zerolearn.config import check_output_folder
from zerolearn.errors import ConfigError

MAX_WORLD_SIZE = 64  # gloo ranks on this machine's CPU cores
MAX_REPEATS = 1000


def _print(results: dict) -> None:
    for st in results["stages"]["stages"]:
        r = st["summary"][0]
        calls = {op: n for op, n in r["calls_by_op"].items() if n}
        print(f"stage {st['stage']}: {st['buckets']} buckets, calls {calls}, step {r['step_s'] * 1e3:.1f} ms, "
              f"overlap {r['overlap']:.2f}, wait {r['wait_s'] * 1e3:.1f} ms, of which {r['release_s'] * 1e3:.1f} ms "
              "after completion (rank 0)")
    for row in results["sweep"]["rows"]:
        print(f"bucket {row['bucket_mb']:g} MiB: {row['buckets']} buckets, step {row['step_s'] * 1e3:.1f} ms, "
              f"backward overlap {row['backward_overlap']:.2f}, backward wait {row['backward_wait_s'] * 1e3:.1f} ms")
    for run in results["prefetch"]["runs"]:
        print(f"ZeRO-3 prefetch {'on ' if run['prefetch'] else 'off'}: forward all_gather overlap "
              f"{run['forward_overlap']:.2f}, forward wait {run['forward_wait_s'] * 1e3:.1f} ms, step "
              f"{run['step_s'] * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolearn.timeline", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the JSON results (created)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="recorded steps per sweep point and prefetch setting")
    p.add_argument("--traces", default=None, metavar="DIR", help="also write Chrome traces (one per run and rank)")
    args = p.parse_args(argv)
    for name, value, high in (("--world-size", args.world_size, MAX_WORLD_SIZE),
                              ("--repeats", args.repeats, MAX_REPEATS)):
        if not 1 <= value <= high:
            p.error(f"{name} {value}: allowed are 1 to {high}")
    try:
        check_output_folder("--out", args.out)
        if args.traces is not None:
            check_output_folder("--traces", args.traces)
    except ConfigError as e:
        p.error(str(e))
    for option, folder in (("--out", args.out), ("--traces", args.traces)):
        try:  # made before recording, so a folder that cannot be made costs no recording
            if folder is not None:
                os.makedirs(folder, exist_ok=True)
        except OSError as e:
            p.error(f"{option} {folder}: cannot be created ({e.strerror}: {e.filename})")
    t0 = time.perf_counter()
    results = timeline.record_all(args.world_size, args.traces, args.repeats)
    for key, name in timeline.FILES.items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(results[key], f, separators=(",", ":"))
            f.write("\n")
    _print(results)
    print(f"wrote {', '.join(timeline.FILES.values())} to {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
