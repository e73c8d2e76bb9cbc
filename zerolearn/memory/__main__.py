"""``python -m zerolearn.memory``: per-device memory of every ZeRO stage, and the smallest fit.

Examples::

    python -m zerolearn.memory --params 7.5e9 --nd 64        # Fig 1: 120, 31.4, 16.6, 1.9 GB
    python -m zerolearn.memory --params 7e9 --device-gb 80    # stage 1 on 2 GPUs, 70 GB each
    python -m zerolearn.memory --layers 48 --hidden 1600 --batch 32 --seq-len 1024

GB is the paper's decimal GB (1e9 bytes). ``--json`` prints bytes. Exit codes: 0
success, 2 bad arguments (the message names the option and what is allowed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from zerolearn.errors import ConfigError, require_count, require_real
from zerolearn.memory.fit import DEFAULT_MAX_ND, ActivationSpec, Fit, gpt_params, smallest_fit, table
from zerolearn.memory.model import GB, STAGE_NAMES, V100_BYTES, optimizer_k
from zerolearn.tables import text_table

SWEEP = [2**i for i in range(11)]  # 1, 2, 4, ..., 1024: Table 1's range and more rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerolearn.memory",
                                description="Per-device memory of ZeRO stages 0-3 (paper Sec 5, Fig 1, Table 1) "
                                            "and the fewest GPUs that fit a device. GB = 1e9 bytes.")
    p.add_argument("--params", type=float, help="model size Psi in parameters, e.g. 7.5e9")
    p.add_argument("--layers", type=int,
                   help="GPT layers: gives Psi unless --params is set; sizes activations with --batch")
    p.add_argument("--hidden", type=int, help="GPT hidden size (with --layers)")
    p.add_argument("--vocab", type=int, default=50257, help="GPT vocabulary (default: GPT-2's 50257)")
    p.add_argument("--nd", type=int, help="one data-parallel degree (default: sweep 1, 2, 4, ..., 1024)")
    p.add_argument("--device-gb", type=float, default=V100_BYTES / GB,
                   help="memory per device in decimal GB (default: 32, the paper's V100)")
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
    p.add_argument("--no-momentum", action="store_true", help="SGD without momentum (K smaller by 4)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16",
                   help="working dtype of params and grads (default bf16; bf16/fp16 give K = 12 with Adam)")
    p.add_argument("--nm", type=int, default=1, help="model-parallel degree (default 1)")
    p.add_argument("--batch", type=int, help="sequences per GPU; adds activations (needs --layers, --hidden)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--checkpointing", action="store_true", help="keep only each block's input (Sec 6.1)")
    p.add_argument("--cb-mb", type=float,
                   help="ZeRO-R's constant-size fused buffer in MB (CB, Sec 6.2); default: one fp32 buffer "
                        "for all gradients, 4 Psi / Nm bytes (Sec 3.2)")
    p.add_argument("--max-nd", type=int, default=DEFAULT_MAX_ND, help="largest Nd the fit search tries")
    p.add_argument("--json", action="store_true", help="print JSON with bytes instead of a table")
    return p


_COUNTS = ("layers", "hidden", "vocab", "nd", "nm", "batch", "seq_len", "max_nd")
_SIZES = ("params", "device_gb", "cb_mb")


def _check_options(args: argparse.Namespace) -> None:
    """Refuse bad numbers before any work, naming the option as the user typed it."""
    for name in _COUNTS:
        if getattr(args, name) is not None:
            require_count(f"--{name.replace('_', '-')}", getattr(args, name))
    for name in _SIZES:
        if getattr(args, name) is not None:
            require_real(f"--{name.replace('_', '-')}", getattr(args, name))
    for name, unit in (("device_gb", GB), ("cb_mb", 1e6)):  # in bytes, still a finite number
        if getattr(args, name) is not None and not math.isfinite(getattr(args, name) * unit):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name):g}: too large; allowed are up to "
                              f"{sys.float_info.max / unit:.3g}")


def _psi(args: argparse.Namespace) -> int | float:
    """Psi from --params or from --layers/--hidden; errors name the options."""
    if (args.layers is None) != (args.hidden is None):
        raise ConfigError("--layers and --hidden go together: give both or neither")
    if args.params is not None:
        # 7.5e9 arrives as a float; an exact int keeps model.py's arithmetic exact.
        return int(args.params) if args.params.is_integer() else args.params
    if args.layers is None:
        raise ConfigError("give the model size: --params N, or --layers L --hidden H")
    return gpt_params(args.layers, args.hidden, args.vocab, args.seq_len)


def _activation(args: argparse.Namespace) -> ActivationSpec | None:
    if args.batch is None:
        for option, given in (("--checkpointing", args.checkpointing), ("--cb-mb", args.cb_mb is not None)):
            if given:
                raise ConfigError(f"{option} needs --batch (residual states are counted only with a batch)")
        return None
    if args.layers is None:
        raise ConfigError("--batch needs --layers and --hidden to size the activations")
    cb = None if args.cb_mb is None else max(int(args.cb_mb * 1e6), 1)
    return ActivationSpec(hidden=args.hidden, layers=args.layers, batch_per_gpu=args.batch,
                          seq_len=args.seq_len, checkpointing=args.checkpointing, constant_buffer_bytes=cb)


def _describe(psi: float, args: argparse.Namespace, activation: ActivationSpec | None) -> str:
    k = optimizer_k(args.optimizer, args.dtype, not args.no_momentum)
    what = "model states"
    if activation is not None:
        kind = "checkpointed" if activation.checkpointing else "full"
        what += f" + {kind} activations (batch {activation.batch_per_gpu} x seq {activation.seq_len})"
        what += " + one block's recomputation" if activation.checkpointing else ""
        what += (" + a fused fp32 gradient buffer" if activation.constant_buffer_bytes is None
                 else " + constant-size buffers (CB)")
    return f"psi = {psi:.4g} parameters, {args.dtype} {args.optimizer} (K = {k}), Nm = {args.nm}: {what}"


def _breakdown_line(row: dict) -> str:
    """Where DP's bytes at this Nd go, category by category (Sec 3.1, 3.2)."""
    b = row["stages"][0]
    parts = [("params", "params"), ("grads", "grads"), ("optimizer_states", "optimizer states"),
             ("activations", "activations"), ("recompute", "recompute"), ("temporary_buffers", "buffers")]
    return (f"DP at Nd = {row['nd']}: " + " + ".join(f"{b[key] / GB:.1f} {name}" for key, name in parts if b[key])
            + f" = {b['total'] / GB:.1f} GB")


def _lowest_stage_line(row: dict, device_bytes: float) -> str:
    """For a single --nd: the lowest stage that fits at exactly that Nd."""
    fitting = [s for s, b in enumerate(row["stages"]) if b["total"] <= device_bytes]
    if not fitting:
        return f"At Nd = {row['nd']} no stage fits."
    stage = fitting[0]
    return f"At Nd = {row['nd']} the lowest stage that fits is {STAGE_NAMES[stage]} (stage {stage})."


def _fit_line(fit: Fit | None, device_bytes: float, max_nd: int) -> str:
    device = f"{device_bytes / GB:g} GB device"
    if fit is None:
        return f"Nothing fits a {device} at any Nd <= {max_nd}."
    gpus = f"{fit.gpus} GPU{'s' if fit.gpus > 1 else ''}" + (f" (Nd = {fit.nd} x Nm = {fit.nm})" if fit.nm > 1 else "")
    return (f"Smallest fit on a {device}: {fit.stage_name} (stage {fit.stage}) on {gpus}, "
            f"{fit.bytes_per_device / GB:.1f} GB per device, {fit.headroom_bytes / GB:.1f} GB headroom "
            f"({fit.utilization:.0%} used).")


def _print_table(rows: list[dict], device_bytes: float) -> None:
    # A trailing * marks a cell that does not fit the device (a space keeps the digits aligned).
    print(text_table(["Nd", *STAGE_NAMES.values()],
                     [[row["nd"], *(f"{s['total'] / GB:.1f}" + ("*" if s["total"] > device_bytes else " ")
                                    for s in row["stages"])] for row in rows]))
    print(f"GB per device (1 GB = 1e9 bytes); * = over the {device_bytes / GB:g} GB device.")


def _json(psi: float, args: argparse.Namespace, activation: ActivationSpec | None,
          rows: list[dict], fit: Fit | None, device_bytes: float) -> dict:
    return {
        "psi": psi, "optimizer": args.optimizer, "dtype": args.dtype, "nm": args.nm,
        "k": optimizer_k(args.optimizer, args.dtype, not args.no_momentum),
        "device_bytes": device_bytes,
        "activation": None if activation is None else dataclasses.asdict(activation),
        "rows": [{"nd": row["nd"],
                  "stages": [{"stage": s, "name": STAGE_NAMES[s], **b, "fits": b["total"] <= device_bytes}
                             for s, b in enumerate(row["stages"])]} for row in rows],
        "smallest_fit": None if fit is None else {
            "stage": fit.stage, "name": fit.stage_name, "nd": fit.nd, "nm": fit.nm, "gpus": fit.gpus,
            "bytes_per_device": fit.bytes_per_device, "headroom_bytes": fit.headroom_bytes},
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_options(args)
        psi = _psi(args)
        activation = _activation(args)
        device_bytes = args.device_gb * GB
        common = {"optimizer": args.optimizer, "dtype": args.dtype, "momentum": not args.no_momentum,
                  "nm": args.nm, "activation": activation}
        rows = table(psi, [args.nd] if args.nd is not None else SWEEP, **common)
        fit = smallest_fit(psi, device_bytes, max_nd=args.max_nd, **common)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.json:
        print(json.dumps(_json(psi, args, activation, rows, fit, device_bytes), indent=1))
        return 0
    print(_describe(psi, args, activation))
    _print_table(rows, device_bytes)
    if args.nd is not None:
        print(_lowest_stage_line(rows[0], device_bytes))
        if activation is not None:
            print(_breakdown_line(rows[0]))
    print(_fit_line(fit, device_bytes, args.max_nd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
