"""``python -m zerolearn.bench scaling``: the stages against world size and model size.

    python -m zerolearn.bench scaling --out notebooks/data/bench/scaling.json

Two sweeps with the benchmark's harness (:mod:`zerolearn.bench.harness`), each point one
launch of fresh ranks on which every system trains in rotated rounds:

* world size (``--world-sizes``, default 1, 2, 4) at the base width;
* model size (``--widths``, default d_model 64, 128, 192, 256: Psi from 137 thousand
  to 1.7 million, 12.6x) at the base world size.

Per point and system: step time (median, quartiles; seconds), the model-state bytes each
rank holds (measured from its tensors), zerolearn's measured traffic per step (the
ledger of :mod:`zerolearn.comm`, elements) and beside them the paper's expectation:
bytes from Sec 5 / Fig 1 in fp32 terms (4 + 4 + 8 bytes per parameter for params,
grads and Adam's states, split by stage: (4 + 4 + 8) Psi, (4 + 4) Psi + 8 Psi / Nd,
4 Psi + 12 Psi / Nd, 16 Psi / Nd) and traffic from Sec 7 (2 Psi for stages 0-2, 3 Psi
for stage 3). :func:`zerolearn.figures.bench.scaling_figure` draws the stored result.
"""

from __future__ import annotations

import argparse
import sys

from zerolearn.bench import harness, results
from zerolearn.bench.spec import (
    PROG,
    STAGE,
    ZEROLEARN,
    BenchSpec,
    add_spec_options,
    check_out,
    parse_systems,
    spec_from_args,
)
from zerolearn.bench.systems import count_params
from zerolearn.errors import ConfigError, require_count
from zerolearn.memory import model as analytic

WORLD_SIZES = (1, 2, 4)
WIDTHS = (64, 128, 192, 256)
BASE = BenchSpec(world_size=4, rounds=2, warmup=1, steps=3, d_model=128, n_layer=2, systems=ZEROLEARN)
"""The scaling runs' defaults: the world-size sweep runs at ``d_model`` 128, the
model-size sweep at world size 4."""


def points(base: BenchSpec, world_sizes, widths) -> list[tuple[int, int]]:
    """(world size, d_model) of every point: the world sweep at ``base.d_model``, then
    the width sweep at ``base.world_size``; a point in both runs once."""
    out = [(w, base.d_model) for w in world_sizes] + [(base.world_size, d) for d in widths]
    return list(dict.fromkeys(out))


def point_entry(spec: BenchSpec, ranks: list[dict]) -> dict:
    """One point of the sweep: Psi and, per system, what was measured and what the paper expects."""
    psi = count_params(spec.train_config())
    entry = {"world_size": spec.world_size, "d_model": spec.d_model, "psi": psi, "systems": {}}
    for name in spec.systems:
        got = [rank[name] for rank in ranks]
        errors = [run["error"] for runs in got for run in runs if "error" in run]
        if errors or any(len(runs) < spec.rounds for runs in got):
            entry["systems"][name] = {"error": errors[0] if errors else "a rank stopped early"}
            continue
        s = results.summarize_system(spec, [[runs[r] for runs in got] for r in range(spec.rounds)])
        stage = STAGE[name]
        entry["systems"][name] = {
            "stage": stage, **{k: s[k] for k in ("median_s", "q1_s", "q3_s", "min_s", "max_s", "losses",
                                                "comm_elements_per_step")},
            "bytes": [r["bytes"] for r in s["ranks"]],
            "expected_bytes": results.formula_bytes(psi, spec.world_size, stage),
            "expected_comm_elements_per_step": analytic.comm_volume_elements(psi, stage)}
    return entry


def run_scaling(base: BenchSpec = BASE, world_sizes=WORLD_SIZES, widths=WIDTHS, progress: bool = True) -> dict:
    """Both sweeps; ``{"spec": base, "world_sizes", "widths", "points": [point_entry, ...]}``.

    Raises:
        ConfigError: a point that cannot run (checked for every point before the first starts).
        zerolearn.dist.RankError, TimeoutError: a point's ranks failed or took too long.
    """
    from tqdm.auto import tqdm

    specs = [base.replace(world_size=w, d_model=d).check() for w, d in points(base, world_sizes, widths)]
    out = []
    for spec in tqdm(specs, desc="scaling", unit="point", disable=not progress):
        out.append(point_entry(spec, harness.run_round(spec, spec.systems, rounds=spec.rounds)))
    return {"spec": base.as_dict(), "world_sizes": list(world_sizes), "widths": list(widths), "points": out}


def format_table(result: dict) -> str:
    """One row per point and system: step time, rank 0's bytes against the formula, traffic in Psi."""
    from zerolearn.tables import text_table

    rows = []
    for p in result["points"]:
        for name, s in p["systems"].items():
            if "error" in s:
                rows.append([p["world_size"], p["d_model"], p["psi"], name, f"failed: {s['error']}"[:60]])
                continue
            held = sum(s["bytes"][0].values())
            comm = s["comm_elements_per_step"]
            rows.append([p["world_size"], p["d_model"], p["psi"], name, f"{s['median_s'] * 1e3:.3g}", held,
                         f"{sum(s['expected_bytes'].values()):,.0f}",
                         "-" if comm is None else f"{comm / p['psi']:.3f}",
                         f"{s['expected_comm_elements_per_step'] / p['psi']:g}"])
    return text_table(["Nd", "d_model", "Psi", "system", "step ms\nmedian", "rank 0 bytes\nmeasured",
                       "bytes\nSec 5", "traffic Psi\nmeasured", "traffic Psi\nSec 7"], rows,
                      align=["right"] * 3 + ["left"] + ["right"] * 5)


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text}: must be comma-separated integers") from None
    for v in values:
        require_count(flag, v)
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} scaling", description="zerolearn's stages against world size "
                                "and model size, beside the paper's bytes (Sec 5) and traffic (Sec 7).")
    add_spec_options(p, BASE)
    p.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)), help="the world-size sweep")
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="the model-size sweep (d_model)")
    p.add_argument("--systems", help="default: zerolearn's four stages; peers are optional (see the bench)")
    args = p.parse_args(argv)
    try:
        base = spec_from_args(args, BASE)
        if args.systems:
            base = base.replace(systems=parse_systems(args.systems))
        world_sizes, widths = _ints("--world-sizes", args.world_sizes), _ints("--widths", args.widths)
        check_out(args.out)
        result = run_scaling(base, world_sizes, widths, progress=not args.no_progress)
    except ConfigError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(format_table(result))
    results.write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
