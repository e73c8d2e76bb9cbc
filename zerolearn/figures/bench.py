"""The figure of the scaling benchmark (chapter 7): measured points beside the paper.

:func:`scaling_figure` draws a result of ``python -m zerolearn.bench scaling`` (stored
in ``notebooks/data/bench/scaling.json``): model-state bytes per rank (markers: measured
from rank 0's tensors; lines: Sec 5 / Fig 1 in fp32 terms, 4 + 4 + 8 bytes per
parameter), traffic per step in units of Psi (markers: zerolearn's ledger; lines: Sec 7's
2 Psi and 3 Psi) and step time (median, whiskers from the first to the third quartile),
against world size (top row) and against Psi (bottom row). Units: bytes in data, binary
MiB (2**20 bytes) on the axes, milliseconds for time.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from zerolearn.figures.formulas import STAGE_COLORS
from zerolearn.memory.model import STAGE_NAMES

__all__ = ["load_result", "scaling_figure", "scaling_series"]


def load_result(result: dict | str | Path) -> dict:
    """A stored result (a path to its JSON) or the dict itself."""
    if isinstance(result, dict):
        return result
    return json.loads(Path(result).read_text())


def scaling_series(result: dict | str | Path, sweep: str) -> dict[str, dict[str, list]]:
    """Per system, the points of one sweep as plottable lists.

    ``sweep``: ``"world"`` (points at the base width, x = world size) or ``"psi"``
    (points at the base world size, x = Psi). Each system's dict holds ``x``,
    ``bytes`` and ``expected_bytes`` (rank 0's total, bytes), ``comm_psi`` (measured
    elements per step over Psi; None where not measured) and ``expected_comm_psi``,
    ``median_ms``, ``q1_ms``, ``q3_ms``, and ``stage``.

    Raises:
        ValueError: ``sweep`` is neither "world" nor "psi".
    """
    result = load_result(result)
    spec = result["spec"]
    if sweep == "world":
        chosen = [p for p in result["points"] if p["d_model"] == spec["d_model"]]
        x_of = lambda p: p["world_size"]  # noqa: E731
    elif sweep == "psi":
        chosen = [p for p in result["points"] if p["world_size"] == spec["world_size"]]
        x_of = lambda p: p["psi"]  # noqa: E731
    else:
        raise ValueError(f"sweep {sweep!r}: allowed are 'world', 'psi'")
    out: dict[str, dict[str, list]] = {}
    for p in sorted(chosen, key=x_of):
        for name, s in p["systems"].items():
            if "error" in s:
                continue
            d = out.setdefault(name, {k: [] for k in ("x", "bytes", "expected_bytes", "comm_psi",
                                                      "expected_comm_psi", "median_ms", "q1_ms", "q3_ms")})
            d["stage"] = s["stage"]
            d["x"].append(x_of(p))
            d["bytes"].append(sum(s["bytes"][0].values()))
            d["expected_bytes"].append(sum(s["expected_bytes"].values()))
            comm = s["comm_elements_per_step"]
            d["comm_psi"].append(None if comm is None else comm / p["psi"])
            d["expected_comm_psi"].append(s["expected_comm_elements_per_step"] / p["psi"])
            for k in ("median", "q1", "q3"):
                d[f"{k}_ms"].append(s[f"{k}_s"] * 1e3)
    return out


def _count(value: float, _pos=None) -> str:
    """A tick label without exponents: 137k, 1.73M, 4."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _panel_row(axes, series: dict, xlabel: str) -> None:
    ax_bytes, ax_comm, ax_time = axes
    for name, d in series.items():
        color = STAGE_COLORS[d["stage"]]
        ours = name.startswith("zerolearn")
        label = f"{d['stage']} {STAGE_NAMES[d['stage']]}" if ours else name
        marker = "o" if ours else "s"
        ax_bytes.plot(d["x"], [b / 2**20 for b in d["bytes"]], marker, color=color, mfc="none" if not ours else color,
                      label=f"{label}, measured")
        if ours:
            ax_bytes.plot(d["x"], [b / 2**20 for b in d["expected_bytes"]], "-", color=color, alpha=0.6,
                          label=f"{label}, Sec 5")
            measured = [(x, c) for x, c in zip(d["x"], d["comm_psi"], strict=True) if c is not None]
            # Stages 0-2 all move 2 Psi: shrinking markers keep each one visible.
            ax_comm.plot([x for x, _ in measured], [c for _, c in measured], marker, color=color, label=label,
                         markersize=10 - 2 * d["stage"])
            ax_comm.plot(d["x"], d["expected_comm_psi"], "-", color=color, alpha=0.6)
        err = [[m - q1 for m, q1 in zip(d["median_ms"], d["q1_ms"], strict=True)],
               [q3 - m for m, q3 in zip(d["median_ms"], d["q3_ms"], strict=True)]]
        ax_time.errorbar(d["x"], d["median_ms"], yerr=err, fmt=marker + "-", color=color, capsize=3,
                         mfc="none" if not ours else color, label=label)
    ax_bytes.set_ylabel("model states per rank (MiB)")
    ax_comm.set_ylabel("traffic per step (Psi)")
    ax_time.set_ylabel("step time (ms)")
    ax_comm.set_ylim(0, 3.6)
    xs = sorted({x for d in series.values() for x in d["x"]})
    for ax in axes:  # both sweeps double their x: a log axis spaces the points evenly
        ax.set_xlabel(xlabel)
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(FuncFormatter(_count))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    ax_bytes.set_yscale("log")
    ax_bytes.yaxis.set_major_formatter(FuncFormatter(_count))
    low, high = ax_bytes.get_ylim()
    # Within one decade there are no major ticks to read: label the minor ones then.
    ax_bytes.yaxis.set_minor_formatter(FuncFormatter(_count) if high / low < 10 else NullFormatter())


def scaling_figure(result: dict | str | Path, title: str | None = None) -> Figure:
    """The scaling result as a 2 x 3 figure: bytes, traffic and step time per stage,
    against world size (top) and Psi (bottom); markers measured, lines the paper."""
    result = load_result(result)
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    axes = fig.subplots(2, 3)
    spec = result["spec"]
    _panel_row(axes[0], scaling_series(result, "world"), f"world size Nd (d_model {spec['d_model']})")
    _panel_row(axes[1], scaling_series(result, "psi"), f"parameters Psi (Nd = {spec['world_size']})")
    axes[0][0].legend(fontsize=7, ncol=2)
    axes[0][1].legend(fontsize=7, title="markers measured, lines Sec 7", title_fontsize=7)
    axes[0][0].set_title("model-state bytes: markers measured, lines Sec 5 (fp32 Adam)", fontsize=9)
    axes[0][1].set_title("traffic per step (ledger) vs 2 Psi / 3 Psi", fontsize=9)
    axes[0][2].set_title("step time, median and quartiles", fontsize=9)
    fig.suptitle(title or f"zerolearn's stages on {spec['device']}: {spec['rounds']} rounds x {spec['steps']} "
                 "timed steps per point")
    return fig
