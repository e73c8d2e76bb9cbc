"""Your engine trains: the end of chapters 1-4, where the reader's exercise functions,
assembled into :class:`zerolearn.nano.NanoZero`, train the exercises' GPT on real ranks
beside one process and beside the package's engine (paper Sec 5.1-5.3, Sec 7.2, Fig 1).

One call, :func:`your_engine`, runs three trainings of the same GPT (Psi = 42,368, the
model of the exercises' trials) on the same global batches with fp32 Adam:

* one process on the whole batch, the reference every ZeRO stage must equal;
* ``NanoZero(model, stage, lr, parts=...)`` on ``nd`` ranks, made of the reader's
  functions (``parts``) and, for every part not given, the book's solution;
* the package's engine for the same stage (``zerolearn.engines.make_engine``).

and prints one row per training: the losses, the largest relative difference from one
process, the model-state bytes a rank holds beside Fig 1's formula for that engine, and
the elements moved per step in units of Psi beside Sec 7's 2 / 2 / 2 / 3 (7.1 for DP, 7.2 for ZeRO).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.exercises.helpers import ADAM_LR, GPT, GPT_BATCH, loss_of
from zerolearn.memory import model as analytic
from zerolearn.models import build_model
from zerolearn.ranks import RankError
from zerolearn.tables import kib, text_table
from zerolearn.watch import watching

STEPS = 4
CATEGORIES = ("params", "grads", "optimizer_states")


def _train(engine, steps: int) -> dict:
    """``steps`` Adam steps of ``engine`` on this rank's slice of each global batch: the global
    losses, the bytes held (gradients as backward leaves them), the elements moved per step."""
    ctx = zdist.context()
    comm.LEDGER.reset()
    losses, grads = [], 0
    with watching():  # the reader's parts call torch's collectives by name: booked here, comm's once
        for step in range(steps):
            x, y = data.gpt_batch(step, GPT_BATCH, GPT.seq_len, seed=0)
            x, y = data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            grads = engine.model_state_bytes()["grads"]
            engine.step()
            engine.zero_grad()
            losses.append(comm.monitor_mean(loss.item()))
    moved = comm.LEDGER.volume_elements() / steps
    return {"losses": losses, "bytes": {**engine.model_state_bytes(), "grads": grads}, "moved": moved,
            "padding": engine.padding}


def _on_rank(stage: int, parts: dict[str, Callable], steps: int, prefetch: bool) -> dict:
    """Both engines on this rank, the reader's first; a part that still raises
    NotImplementedError is reported by name instead of training."""
    from zerolearn.engines import make_engine
    from zerolearn.nano import NanoZero

    out = {}
    try:
        model = build_model("gpt", 0, gpt=GPT)
        out["yours"] = _train(NanoZero(model, stage, ADAM_LR, parts=parts, prefetch=prefetch), steps)
    except NotImplementedError as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        out["missing"] = tb.tb_frame.f_code.co_name
    model = build_model("gpt", 0, gpt=GPT)
    out["package"] = _train(make_engine(stage, model, optimizer="adam", lr=ADAM_LR, dtype="fp32"), steps)
    return out


def one_process(steps: int = STEPS) -> list[float]:
    """The reference: the same GPT, whole global batches, ``torch.optim.Adam``, in this process."""
    model = build_model("gpt", 0, gpt=GPT)
    opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    losses = []
    for step in range(steps):
        x, y = data.gpt_batch(step, GPT_BATCH, GPT.seq_len, seed=0)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@dataclass
class Trained:
    """What :func:`your_engine` measured: per row (``"one process"``, ``"your engine"``,
    ``"package engine"``) the global losses, bytes held per rank by Fig 1's category, and
    elements moved per step; ``missing`` names a part not written yet (then no reader's row)."""

    stage: int
    nd: int
    psi: int
    rows: dict[str, dict]
    missing: str | None = None

    def max_rel_diff(self, name: str) -> float:
        """Largest |loss - one process's| / one process's over the steps."""
        ref = self.rows["one process"]["losses"]
        return max(abs(a - b) / abs(b) for a, b in zip(self.rows[name]["losses"], ref, strict=True))

    def formula(self, name: str) -> dict:
        """Fig 1's bytes per rank for this row's engine (fp32 parameters and gradients, 4
        bytes each): K = 12 for the reader's engine, whose ``zero1_step`` writes an fp32 master
        even in fp32; K = 8 for the package's, whose fp32 master is the parameter itself."""
        k = 12 if name == "your engine" else analytic.optimizer_k("adam", "fp32")
        return analytic.model_state_bytes(self.psi + self.rows[name]["padding"], self.nd, self.stage, k=k,
                                          param_bytes=4, grad_bytes=4)

    def per_parameter(self, k: int) -> str:
        """Fig 1's bytes per parameter at this stage and Nd, as a sum: 4 (parameters), 4
        (gradients) and ``k`` (optimizer states), each divided by Nd where the stage
        partitions it (Sec 5.1-5.3)."""
        terms = [(4, self.stage >= 3), (4, self.stage >= 2), (k, self.stage >= 1)]
        text = " + ".join(f"{b} / {self.nd}" if split else f"{b}" for b, split in terms)
        return f"{text} = {sum(b / self.nd if split else b for b, split in terms):g}"

    def table(self) -> str:
        """The rows as text: losses, difference from one process, KiB per rank measured | Fig 1,
        the same bytes per parameter (Psi), Psi moved per step measured | Sec 7.1 (DP) or 7.2 (ZeRO)."""
        theory = analytic.comm_volume_elements(self.psi, self.stage) / self.psi
        out = []
        for name, row in self.rows.items():
            losses = " ".join(f"{v:.4f}" for v in row["losses"])
            if name == "one process":
                out.append([name, losses, "", "", "", ""])
                continue
            held, formula = sum(row["bytes"][c] for c in CATEGORIES), self.formula(name)["total"]
            diff = self.max_rel_diff(name)
            out.append([name, losses, "< 1e-6" if diff < 1e-6 else f"{diff:.0e}", f"{kib(held)} | {kib(formula)}",
                        f"{held / self.psi:.1f}", f"{row['moved'] / self.psi:.2f} | {theory:.0f}"])
        section = "Sec 7.1" if self.stage == 0 else "Sec 7.2"  # DP's volume, then ZeRO's
        header = ["", "loss at each step", "vs one process", "KiB per rank | Fig 1", "bytes per\nparameter",
                  f"Psi moved per step | {section}"]
        return text_table(header, out)

    def __str__(self) -> str:
        title = (f"{analytic.stage_title(self.stage)} on {self.nd} ranks: the GPT of the exercises "
                 f"(Psi = {self.psi:,}), fp32 Adam, global batch {GPT_BATCH}")
        note = "" if self.missing is None else (
            f"\n\n{self.missing} still raises NotImplementedError: write it above, run its check, then this cell.")
        fig1 = ("Fig 1 here: fp32 parameters and gradients (4 + 4 bytes) and Adam's K, 12 for yours "
                "(zero1_step writes an fp32 master even in fp32) and 8 for the package's (in fp32 its master "
                f"is the parameter); at this stage, bytes per parameter: yours {self.per_parameter(12)}, "
                f"the package's {self.per_parameter(8)} (per element of the padded Psi).")
        return f"{title}\n\n{self.table()}\n\n{fig1}{note}"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def your_engine(stage: int, parts: dict[str, Callable], *, nd: int = 2, steps: int = STEPS,
                prefetch: bool = False) -> Trained:
    """Train the exercises' GPT with the reader's ``parts`` in ``NanoZero`` at ``stage`` on
    ``nd`` gloo ranks, beside one process and the package's engine; print the result with
    ``print(...)`` or let the notebook show it.

    Args:
        stage: 0 (DP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p).
        parts: the reader's functions by name (``zerolearn.nano.PARTS``); the rest are the
            book's solutions.
        nd: ranks (2 or more); steps: Adam steps (lr 1e-3, global batch 12 sequences of 16 bytes).
        prefetch: stage 3 gathers with the ``prefetch`` part instead of ``gather_hooks``.

    Raises:
        ConfigError: a bad stage or part name (from ``NanoZero``).
        RankError: a part raised something other than NotImplementedError on a rank; the message
            names the rank and the reader's line.
    """
    from zerolearn.nano import NanoZero  # noqa: F401 - the options are checked before ranks start

    NanoZero.check_options(stage, "fp32", parts)
    try:
        results = zdist.launch(_on_rank, nd, stage, parts, steps, prefetch)
    except RankError as e:
        raise RankError(e.rank, f"your engine failed (the part's own exercises.check names the bug): "
                                f"{str(e).split(': ', 1)[-1]}") from None
    first = results[0]
    psi = sum(p.numel() for p in build_model("gpt", 0, gpt=GPT).parameters())
    rows = {"one process": {"losses": one_process(steps)}}
    if "yours" in first:
        rows["your engine"] = first["yours"]
    rows["package engine"] = first["package"]
    return Trained(stage, nd, psi, rows, first.get("missing"))
