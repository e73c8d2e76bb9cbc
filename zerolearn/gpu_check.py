"""The GPU acceptance run: every number the book teaches, measured on CUDA, in one command.

    make gpu-check        (or: python -m zerolearn.gpu_check [--only NAME,...] [--dry-run])

Runs the checks of :func:`plan` one after the other (about 6 minutes on one GPU; each
check's estimate is in the plan) and exits 1 if any number is wrong, naming it:

* ``stages-fp32``, ``stages-bf16``, ``stages-fp16``: the small GPT at stages 0-3 on NCCL
  (world size 1: NCCL puts one rank on one GPU): bytes held equal the formula, 2 / 2 / 2 /
  3 Psi moved per step, losses equal across stages;
* ``seed-2``, ``seed-8``: the blog's seed experiment at full width (6 x 10,000, fp32 Adam)
  on 2 and 8 simulated ranks, each stage in a fresh process and all four in one
  process: ZeRO-2's peak below ZeRO-1's both ways, and the same peaks both ways;
* ``zero-r``, ``offload``, ``zeropp``: ZeRO-R's checkpoints (P_a, P_a+cpu, MD), offload to
  the host and to disk (stage 3's parameters too) and DPU, ZeRO++'s qwZ + hpZ + qgZ,
  each against the plain run's losses;
* ``checkpoint``: 3 steps saved, resumed for steps 4-6, equal to 6 steps in one run;
* ``chapter-scripts``: ``torchrun -m zerolearn.experiments.{dp,zero1,zero2,zero3}``;
* ``bench-1024``: the bench against torch's systems at d_model 1024;
* ``md``: MD (Sec 6.3) from torch's allocator statistics;
* with two GPUs or more, ``tour-all-gpus`` and ``stage3-all-gpus`` on every GPU.

Each check writes ``OUT/NAME.json``; ``OUT/summary.json`` and ``OUT/summary.txt`` name
the device and the torch, CUDA and NCCL versions, and every check's result (default OUT:
``notebooks/data/gpu``). ``--dry-run`` prints the plan without running anything (no GPU
needed). The checks are plain functions of a :class:`Scale`: the tests run the small
ones at a tiny scale on gloo ranks on the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zerolearn.config import TrainConfig
from zerolearn.errors import ConfigError
from zerolearn.report import CATEGORIES, stage_row
from zerolearn.tables import text_table
from zerolearn.train import train, train_here

OUT = Path(__file__).resolve().parents[1] / "notebooks" / "data" / "gpu"
"""Where the reports go by default."""
BUDGET_S = 360.0
"""The whole run's time on one GPU, seconds (the plan's estimates add up to at most this)."""
LOSS_TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
"""Largest |loss difference| between stages that compute the same thing, by dtype."""
ZEROPP_TOL = 0.1
"""Largest |loss difference| of ZeRO++'s quantized collectives against plain stage 3."""
SAME_PEAK_REL = 0.02
"""A stage's peak in one process may differ from its peak in a fresh process by this fraction."""


class CheckFailed(AssertionError):
    """A number a check measured is wrong; the message names it and what it should be."""


@dataclass(frozen=True)
class Scale:
    """How large a check runs: ``device``/``backend`` of its ranks, the GPT's ``steps``, the
    seed experiment's MLP ``seed_width`` and ``seed_steps``."""

    device: str = "cuda"
    backend: str = "nccl"
    steps: int = 20
    seed_width: int = 10_000
    seed_steps: int = 2


GPU = Scale()
TINY = Scale(device="cpu", backend="gloo", steps=2, seed_width=256, seed_steps=1)
"""What the tests run on the CPU."""


@dataclass(frozen=True)
class Check:
    """One check: its ``name``, estimated ``seconds`` on one H200, the GPUs it needs
    (``min_gpus``), whether it runs at :data:`TINY` scale on the CPU (``cpu``), and
    ``run(scale)``, which returns what it measured (JSON-able) or raises CheckFailed."""

    name: str
    seconds: float
    run: Callable[[Scale], dict] = field(repr=False)
    min_gpus: int = 1
    cpu: bool = True


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def _gpt(scale: Scale, **options) -> TrainConfig:
    return TrainConfig(model="gpt", steps=scale.steps, quiet=True, backend=scale.backend,
                       device=scale.device).replace(**options)


def _run(config: TrainConfig) -> dict:
    """``config`` trained in this process (its own group, torn down after), CUDA caches emptied first."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return train_here(config)


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _close_losses(name: str, got: dict, want: dict, tol: float) -> float:
    diff = _max_diff(got["losses"], want["losses"])
    _require(diff <= tol, f"{name}: losses differ from the plain run's by {diff:.3e} > {tol:g}")
    return diff


# ----- the checks ------------------------------------------------------------------------
def check_stages(dtype: str) -> Callable[[Scale], dict]:
    """Stages 0-3 of the GPT in ``dtype`` at world size 1: bytes = formula, Psi per step, losses."""

    def run(scale: Scale) -> dict:
        rows, reports = [], [_run(_gpt(scale, stage=s, dtype=dtype)) for s in range(4)]
        for report in reports:
            r = stage_row(report)
            rows.append({k: r[k] for k in ("stage", "loss", "psi_per_step", "peak_bytes", "step_ms",
                                              *CATEGORIES, *(c + "_formula" for c in CATEGORIES))})
            for c in CATEGORIES:
                pad = r["padding"] * 16  # at most 16 bytes per padding element (fp32 master + Adam)
                _require(abs(r[c] - r[c + "_formula"]) <= pad,
                         f"stages-{dtype} stage {r['stage']}: {c} {r[c]} bytes, formula {r[c + '_formula']}")
            _require(abs(r["psi_per_step"] - r["psi_per_step_theory"]) < 1e-6,
                     f"stages-{dtype} stage {r['stage']}: {r['psi_per_step']:.3f} Psi per step, "
                     f"Sec 7 says {r['psi_per_step_theory']:g}")
        spread = max(_max_diff(r["losses"], reports[0]["losses"]) for r in reports)
        _require(spread <= LOSS_TOL[dtype], f"stages-{dtype}: losses differ between stages by {spread:.3e}")
        return {"rows": rows, "loss_spread": spread}

    run.__doc__ = f"the GPT at stages 0-3 in {dtype}: bytes = formula, 2/2/2/3 Psi per step, equal losses"
    return run


def _seed_args(scale: Scale, world: int, one_process: bool) -> argparse.Namespace:
    return argparse.Namespace(width=scale.seed_width, layers=6, batch=16, steps=scale.seed_steps, dtype="fp32",
                              bucket_mb=4.0, world_size=None, simulate_world_size=world, one_process=one_process)


def check_seed(world: int) -> Callable[[Scale], dict]:
    """The seed experiment on ``world`` simulated ranks, one stage per process and all in one."""

    def run(scale: Scale) -> dict:
        from zerolearn.experiments import seed_experiment
        from zerolearn.experiments.machine import RankPlan

        where = RankPlan(world, "fake", scale.device, True, "")
        peaks = {}
        for how, one in (("per_process", False), ("one_process", True)):
            reports = seed_experiment.run_all(_seed_args(scale, world, one), where)
            peaks[how] = [r["ranks"][0]["peak_bytes"] for r in reports]
            _require(peaks[how][2] < peaks[how][1], f"seed-{world} ({how}): ZeRO-2's peak {peaks[how][2]} B is "
                     f"not below ZeRO-1's {peaks[how][1]} B")
        for s, (a, b) in enumerate(zip(peaks["per_process"], peaks["one_process"], strict=True)):
            _require(abs(a - b) <= SAME_PEAK_REL * a, f"seed-{world} stage {s}: peak {b} B in one process, {a} B "
                     "in a fresh one (a run left memory behind)")
        return {"world_size": world, "width": scale.seed_width,
                "peak_MiB": {k: [round(v / 2**20, 1) for v in p] for k, p in peaks.items()}}

    run.__doc__ = (f"the seed experiment on {world} simulated ranks, per process and in one: ZeRO-2 below ZeRO-1, "
                   "same peaks")
    return run


def check_zero_r(scale: Scale) -> dict:
    """ZeRO-R's activation checkpoints (P_a, P_a+cpu, MD's contiguous pool) against plain stage 2."""
    plain = _run(_gpt(scale, stage=2))
    zr = _run(_gpt(scale, stage=2, checkpoint_activations=True, partition_activations=True, cpu_checkpointing=True,
                   contiguous_checkpoints=True))
    return {"max_loss_diff": _close_losses("zero-r", zr, plain, LOSS_TOL["fp32"])}


def check_offload(scale: Scale) -> dict:
    """Offload to the host and to disk at stages 2-3 (stage 3 on disk: the parameters too), and
    DPU: equal to the plain run's losses (DPU: the first two steps; later ones one update stale)."""
    out = {}
    for stage in (2, 3):
        plain = _run(_gpt(scale, stage=stage))
        for kind in ("cpu", "disk"):
            got = _run(_gpt(scale, stage=stage, offload=kind))
            out[f"stage{stage}-{kind}"] = _close_losses(f"offload {kind} at stage {stage}", got, plain,
                                                        LOSS_TOL["fp32"])
        dpu = _run(_gpt(scale, stage=stage, offload="cpu", dpu=True))
        head = _max_diff(dpu["losses"][:2], plain["losses"][:2])
        _require(head <= LOSS_TOL["fp32"], f"offload cpu+dpu at stage {stage}: first two steps differ by {head:.3e}")
        _require(all(torch.isfinite(torch.tensor(dpu["losses"])).tolist()), f"DPU at stage {stage}: a loss not finite")
        out[f"stage{stage}-cpu+dpu-first-two"] = head
    return {"max_loss_diff": out}


def check_zeropp(scale: Scale) -> dict:
    """ZeRO++'s qwZ + hpZ + qgZ at stage 3 against plain stage 3 (quantized: within ZEROPP_TOL)."""
    plain = _run(_gpt(scale, stage=3))
    got = _run(_gpt(scale, stage=3, qwz=True, hpz=True, qgz=True, node_size=1))
    return {"max_loss_diff": _close_losses("zeropp", got, plain, ZEROPP_TOL)}


def check_checkpoint(scale: Scale) -> dict:
    """Steps 1-3 saved, steps 4-6 resumed: equal, bit for bit, to 6 steps in one run (stage 3)."""
    whole = _run(_gpt(scale, stage=3, steps=6))
    with tempfile.TemporaryDirectory() as folder:
        _run(_gpt(scale, stage=3, steps=3, checkpoint_dir=folder))
        resumed = _run(_gpt(scale, stage=3, steps=6, checkpoint_dir=folder))
    _require(resumed["losses"] == whole["losses"][3:], f"checkpoint: resumed losses {resumed['losses']} are not "
             f"steps 4-6 of one run {whole['losses'][3:]}")
    return {"losses": resumed["losses"]}


def _command(argv: list[str], timeout_s: float) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    _require(done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return done.stdout


def check_chapter_scripts(scale: Scale) -> dict:
    """Each chapter script under ``torchrun --nproc-per-node 1``: exits 0 and prints its table."""
    out = {}
    for script in ("dp", "zero1", "zero2", "zero3"):
        text = _command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                         "-m", f"zerolearn.experiments.{script}", "--steps", "3", "--quiet"], 300)
        _require("Psi/step" in text, f"chapter script {script}: no table in its output")
        out[script] = text
    return {"outputs": out}


def check_bench(scale: Scale) -> dict:
    """The bench at d_model 1024 against torch's systems (one round): runs and reports."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.json"
        _command([sys.executable, "-m", "zerolearn.bench", "--device", "cuda", "--width", "1024", "--layers", "8",
                  "--heads", "16", "--seq-len", "256", "--batch", "16", "--rounds", "1", "--warmup", "2",
                  "--steps", "5", "--systems", "zerolearn,torch", "--out", str(path)], 600)
        return json.loads(path.read_text())


def check_md(scale: Scale) -> dict:
    """MD (Sec 6.3) on the device: torch's allocator statistics without and with MD."""
    from zerolearn.residual import defrag

    return {"without MD": defrag.cuda_memory(md=False), "with MD": defrag.cuda_memory(md=True)}


def check_tour_all_gpus(scale: Scale) -> dict:
    """The tour on NCCL, one rank per GPU."""
    n = torch.cuda.device_count()
    text = _command([sys.executable, "-m", "zerolearn.tour", "--backend", "nccl", "--world-size", str(n),
                     "--steps", "5"], 600)
    return {"world_size": n, "output": text}


def check_stage3_all_gpus(scale: Scale) -> dict:
    """Stage 3 on every GPU equals stage 3 on one (the global batch does not depend on the world size)."""
    from zerolearn.dist import launch

    n = torch.cuda.device_count()
    many = launch(train, n, _gpt(scale, stage=3), backend="nccl")[0]
    one = _run(_gpt(scale, stage=3))
    return {"world_size": n, "max_loss_diff": _close_losses(f"stage 3 on {n} GPUs", many, one, 1e-4)}


def plan(gpus: int) -> list[Check]:
    """The checks for a machine with ``gpus`` GPUs, in the order they run.

    Raises:
        ConfigError: ``gpus`` not an integer >= 0.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ConfigError(f"gpus={gpus!r}: must be an integer >= 0")
    checks = [*(Check(f"stages-{d}", 25, check_stages(d)) for d in ("fp32", "bf16", "fp16")),
              Check("seed-2", 90, check_seed(2)), Check("seed-8", 60, check_seed(8)),
              Check("zero-r", 8, check_zero_r), Check("offload", 20, check_offload),
              Check("zeropp", 8, check_zeropp), Check("checkpoint", 10, check_checkpoint),
              Check("chapter-scripts", 40, check_chapter_scripts, cpu=False),
              Check("bench-1024", 30, check_bench, cpu=False), Check("md", 10, check_md, cpu=False),
              Check("tour-all-gpus", 60, check_tour_all_gpus, min_gpus=2, cpu=False),
              Check("stage3-all-gpus", 20, check_stage3_all_gpus, min_gpus=2, cpu=False)]
    return [c for c in checks if c.min_gpus <= max(gpus, 1)]


def versions() -> dict:
    """The device and the torch, CUDA and NCCL versions (None where absent)."""
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "gpus": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "python": sys.version.split()[0]}


def run_checks(checks: list[Check], scale: Scale, out: Path) -> dict:
    """Run ``checks`` at ``scale``; write ``out/NAME.json`` for each and ``out/summary.json``,
    ``out/summary.txt``; return the summary (``"failed"``: the names of failed checks)."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for check in checks:
        t0, error = time.perf_counter(), None
        try:
            measured = check.run(scale)
            (out / f"{check.name}.json").write_text(json.dumps(measured, indent=1, default=str))
        except CheckFailed as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a crash is a failed check, named in the summary
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        results.append({"name": check.name, "ok": error is None, "seconds": round(seconds, 1), "error": error})
        print(f"{check.name:<16} {'ok' if error is None else 'FAILED'}  {seconds:6.1f} s"
              + (f"\n    {error}" if error else ""), flush=True)
    summary = {**versions(), "scale": asdict(scale), "checks": results,
               "failed": [r["name"] for r in results if not r["ok"]]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    v = summary
    text = (f"device: {v['device']}, torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}\n"
            + text_table(["check", "result", "seconds"], [[r["name"], "ok" if r["ok"] else "FAILED", r["seconds"]]
                                                          for r in results], align=["left", "left", "right"]))
    (out / "summary.txt").write_text(text + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolearn.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(OUT), help="folder for the reports (default: notebooks/data/gpu)")
    p.add_argument("--only", default=None, help="comma-separated check names (see --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = plan(gpus)
    if args.only:
        names = {c.name for c in checks}
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in names]
        if unknown:
            p.exit(2, f"{p.prog}: error: --only {','.join(unknown)}: allowed are {', '.join(sorted(names))}\n")
        checks = [c for c in checks if c.name in wanted]
    if args.dry_run:
        for c in checks:
            print(f"{c.name:<16} ~{c.seconds:4.0f} s  {(c.run.__doc__ or '').strip().splitlines()[0]}")
        print(f"total ~{sum(c.seconds for c in checks):.0f} s on one GPU ({gpus} GPU(s) here)")
        return 0
    if not gpus:
        p.exit(2, f"{p.prog}: error: CUDA is not available on this machine (--dry-run prints the plan)\n")
    summary = run_checks(checks, GPU, Path(args.out))
    print(Path(args.out, "summary.txt").read_text())
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
