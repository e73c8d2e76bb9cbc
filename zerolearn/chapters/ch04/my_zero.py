"""my_zero.py: ZeRO-DP in one file, made of your functions from chapters 1-4 (paper Sec 5.1-5.3).

Run it on 2 ranks of this machine (gloo), at a stage or several, with the Python that has torch
(the book's is ``.venv/bin/python``; ``torchrun`` is the same launcher, where it is on PATH):

    python -m torch.distributed.run --standalone --nproc-per-node 2 my_zero.py --stage 0 1 2 3

Each stage trains the same small MLP (4 Linear(64, 64) layers, fp32) with Adam for a few
steps, every rank on its slice of each global batch, and checks itself on every rank: the
losses and the final parameters against one process training on the whole batch, and the
bytes this rank holds against the formula of Fig 1 for fp32 Adam with an fp32 master
(K = 12: the master and Adam's two moments), for the padded Psi (each shard is padded to an equal
size; on 3 ranks the padding elements show in the bytes):

    stage   params        grads         optimizer states
    0 DP    4 Psi         4 Psi         12 Psi
    1 P_os  4 Psi         4 Psi         12 Psi / Nd
    2 +g    4 Psi         4 Psi / Nd    12 Psi / Nd
    3 +p    4 Psi / Nd    4 Psi / Nd    12 Psi / Nd

Only torch is needed. The parts are your exercises: ``flatten_params`` (02) lays out the
parameters and gradients, ``average_gradients`` (01) is DP's all-reduce, ``zero1_step`` (02)
is every stage's optimizer step, ``reduce_scatter_hook`` (03) reduces gradients into this
rank's shard during backward, ``gather_hooks`` (04) gathers a layer's parameters around its
forward and backward, and ``main`` (04) is the program: the process group, the model and the
training loop. ``--json`` prints one line per stage for a program to read.

Every rank checks itself, and rank 0 reports every rank: a stage that differs from one process
or from the formula prints which rank, what and by how much, and the script exits with status 1.

(In the package this file is ``zerolearn/chapters/ch04/my_zero.py`` with the book's solutions;
``zerolearn.chapters.ch04.take_home.write`` writes it with yours in their place.)
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# The parts: written here, one after the other, when the script is made from your functions.
from zerolearn.chapters.ch01.average_gradients import average_gradients  # PART
from zerolearn.chapters.ch02.flatten_params import flatten_params  # PART
from zerolearn.chapters.ch02.zero1_step import zero1_step  # PART
from zerolearn.chapters.ch03.reduce_scatter_hook import reduce_scatter_hook  # PART
from zerolearn.chapters.ch04.gather_hooks import gather_hooks  # PART

WIDTH, LAYERS, BATCH, STEPS, LR = 64, 4, 12, 3, 1e-3  # 12 rows: 6 per rank on 2, 4 on 3
K = 12  # optimizer bytes per parameter: the fp32 master and Adam's two fp32 moments
TOLERANCE = 1e-6  # largest relative difference from one process, in fp32
PARTS = ["average_gradients", "flatten_params", "zero1_step", "reduce_scatter_hook", "gather_hooks", "main"]
BOOK_PARTS = PARTS  # BOOK: the parts that are the book's solutions (the script's maker lists them)
STAGE_NAMES = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
ARGS = argparse.Namespace(stage=[0, 1, 2, 3], json=False)  # the command line, once parse_args() has read it


def build_model() -> nn.Module:
    """The same MLP on every rank and in the reference: seeded, fp32."""
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of a global batch."""
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


class Engine:
    """One stage built from the parts. ``flats`` and ``shards`` hold what the step updates:
    one flat buffer for the whole model at stages 0-2, one per layer at stage 3."""

    def __init__(self, model: nn.Module, stage: int, rank: int, world_size: int):
        self.model, self.stage, self.rank, self.nd = model, stage, rank, world_size
        self.states, self.grad_shards, self.shards = [], [], []
        units = [m for m in model if any(True for _ in m.parameters())] if stage == 3 else [model]
        self.flats = []
        for unit in units:
            # DP shards nothing: its buffer is padded for one rank.
            flat, flat_grad = flatten_params(unit, world_size if stage else 1)
            self.flats.append(flat)
            self.states.append({})
            self.flat_grad = flat_grad if stage < 2 else None
            if stage < 2:
                continue
            for p in unit.parameters():  # stages 2-3 keep a gradient shard only
                p.grad = None
            n = flat.numel() // world_size
            self.grad_shards.append(torch.zeros(n))
            reduce_scatter_hook(list(unit.parameters()), self.grad_shards[-1], world_size)
            if stage == 3:  # the shard is the only copy kept; the flat buffer is freed between uses
                self.shards.append(flat[rank * n:(rank + 1) * n].clone())
                flat.untyped_storage().resize_(0)
                gather_hooks(unit, flat, self.shards[-1], world_size)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.stage == 0:
            average_gradients(self.model, self.nd)
        self.held = self.held_bytes()  # gradients as backward leaves them, for the check

    def step(self) -> None:
        for i, flat in enumerate(self.flats):
            if self.stage == 0:
                zero1_step(flat, self.flat_grad, self.states[i], 1, 0, LR, reduced=True, gather=False)
            elif self.stage == 1:
                zero1_step(flat, self.flat_grad, self.states[i], self.nd, self.rank, LR)
            elif self.stage == 2:
                zero1_step(flat, self.grad_shards[i], self.states[i], self.nd, self.rank, LR, reduced=True)
            else:
                zero1_step(self.shards[i], self.grad_shards[i], self.states[i], self.nd, self.rank, LR,
                           reduced=True, gather=False)
        if self.flat_grad is not None:
            self.flat_grad.zero_()  # the parameters' .grad are views of it: backward adds into zeros

    def held_bytes(self) -> dict:
        """Bytes this rank holds now, by the categories of Fig 1, each storage counted once."""
        seen = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                key = t.untyped_storage().data_ptr()
                if t.numel() > 1 and key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            return total

        params = self.shards + self.flats if self.stage == 3 else self.flats
        grads = self.grad_shards if self.stage >= 2 else [self.flat_grad]
        states = []
        for state in self.states:
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    states.append(v)
                elif isinstance(v, torch.optim.Optimizer):
                    states += [p for g in v.param_groups for p in g["params"]]
                    states += [t for s in v.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return {"params": size(params), "grads": size(grads), "optimizer_states": size(states)}

    def full_parameters(self) -> torch.Tensor:
        """Every parameter, end to end (padding dropped), as one process would hold them."""
        out = []
        for i, unit in enumerate(self.model if self.stage == 3 else [self.model]):
            if self.stage == 3:
                if not any(True for _ in unit.parameters()):
                    continue
                flat = torch.empty(self.shards[len(out)].numel() * self.nd)
                dist.all_gather_single(flat, self.shards[len(out)])
            else:
                flat = self.flats[i]
            out.append(flat[:sum(p.numel() for p in unit.parameters())].clone())
        return torch.cat(out)


def formula(stage: int, model: nn.Module, world_size: int) -> dict:
    """Fig 1's bytes per rank in fp32 with an fp32 master (4 + 4 + K), for the padded Psi."""
    units = [m for m in model if any(True for _ in m.parameters())] if stage == 3 else [model]
    nd = world_size if stage else 1
    padded = sum(-(-sum(p.numel() for p in u.parameters()) // nd) * nd for u in units)
    return {"params": 4 * padded // (world_size if stage == 3 else 1),
            "grads": 4 * padded // (world_size if stage >= 2 else 1),
            "optimizer_states": K * padded // (world_size if stage >= 1 else 1)}


def one_process() -> tuple[list[float], torch.Tensor]:
    """The reference: the whole global batch, torch.optim.Adam, in this process. Returns the
    losses (one per step) and every parameter end to end (Psi elements, fp32)."""
    model = build_model()
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        adam.step()
        adam.zero_grad()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def padding(stage: int, model: nn.Module, world_size: int) -> int:
    """Elements added so that every flat buffer splits into equal shards (one buffer for the
    model at stages 1-2, one per layer at stage 3, none at DP)."""
    units = [m for m in model if any(True for _ in m.parameters())] if stage == 3 else [model]
    return sum(-sum(p.numel() for p in u.parameters()) % world_size for u in units) if stage else 0


def problems(r: dict) -> list[str]:
    """What differs in one rank's result ``r`` from one process and from the formula, in words."""
    out = []
    if r["rel_loss"] > TOLERANCE:
        out.append(f"loss of step {r['worst_step']} differs from one process by rel {r['rel_loss']:.1e} "
                   f"(tolerance {TOLERANCE:.0e})")
    if not r["rel_params"] <= TOLERANCE:  # NaN too
        out.append(f"final parameters differ from one process by rel {r['rel_params']:.1e}, most in "
                   f"{r['worst_param']!r} (tolerance {TOLERANCE:.0e})")
    if not r["bytes"]:
        out.append("engine.backward(loss) never ran: the bytes held after backward were not measured")
    for kind, held in r["bytes"].items():
        if held != r["formula"][kind]:
            out.append(f"{kind} hold {held:,} bytes, the formula says {r['formula'][kind]:,}")
    return out


def result(engine: Engine, losses: list[float]) -> dict:
    """This rank's check after ``STEPS`` steps: the global losses (the mean of the ranks' losses,
    one all_reduce), the bytes held after the last backward, and the comparison with one process
    (relative differences: the largest over the steps' losses, and the largest parameter
    difference over the largest parameter)."""
    rank, world_size, stage = engine.rank, engine.nd, engine.stage
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)  # the global mean loss: the ranks' slices are equal
    losses = (total / world_size).tolist()
    want_losses, want_params = one_process()
    params = engine.full_parameters()
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True)]
    diff = (params - want_params).abs()
    ends = torch.tensor([p.numel() for p in engine.model.parameters()]).cumsum(0)
    names = [n for n, _ in engine.model.named_parameters()]
    return {"stage": stage, "world_size": world_size, "rank": rank, "losses": losses,
            "rel_loss": max(rel), "worst_step": rel.index(max(rel)),
            "rel_params": (diff.max() / want_params.abs().max()).item(),
            "worst_param": names[int(torch.searchsorted(ends, diff.argmax(), right=True))],
            "bytes": getattr(engine, "held", {}), "formula": formula(stage, engine.model, world_size),
            "padding": padding(stage, engine.model, world_size)}


def report(engine: Engine, losses: list[float]) -> bool:
    """Check this rank (:func:`result`), gather every rank's check on rank 0 and print it there
    (one line a stage, and a line for each thing that differs; with ``--json``, one JSON line).
    Called on every rank after a stage's steps, with this rank's losses (floats, one a step).
    Returns True when any rank differs from one process or from the formula."""
    r = result(engine, losses)
    everyone = [None] * engine.nd
    dist.all_gather_object(everyone, r)  # rank 0 reports every rank's check
    wrong = [f"rank {e['rank']}: {p}" for e in everyone for p in problems(e)]
    if engine.rank != 0:
        return bool(wrong)
    if ARGS.json:
        print(json.dumps({**r, "ok": not wrong, "wrong": wrong}), flush=True)
        return bool(wrong)
    b, pad = r["bytes"], r["padding"]
    print(f"{STAGE_NAMES[engine.stage]:<6} on {engine.nd} ranks: final loss {r['losses'][-1]:.4f}; "
          f"{'every rank equals one process' if not wrong else 'WRONG'}; bytes held per rank: "
          f"params {b['params']:,}, grads {b['grads']:,}, optimizer {b['optimizer_states']:,} "
          f"({pad} padding element{'' if pad == 1 else 's'}){'' if wrong else ', as the formula says'}", flush=True)
    for line in wrong:
        print(f"    {line}", flush=True)
    return bool(wrong)


def parse_args() -> argparse.Namespace:
    """The command line (``--stage``, ``--json``), kept in ``ARGS`` for :func:`report`; rank 0
    (torchrun's ``RANK``) says which parts are yours."""
    global ARGS
    parser = argparse.ArgumentParser(description="ZeRO-DP made of your functions, checked against one process")
    parser.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--json", action="store_true", help="one JSON line per stage (rank 0)")
    ARGS = parser.parse_args()
    yours = [n for n in PARTS if n not in BOOK_PARTS]
    if os.environ.get("RANK", "0") == "0" and not ARGS.json:
        print(f"parts: yours {', '.join(yours) or 'none'}; the book's {', '.join(BOOK_PARTS) or 'none'}", flush=True)
    return ARGS


def main():
    """The program torchrun runs on every rank: join the process group, then, for each stage
    of ``--stage``, train the MLP for ``STEPS`` steps with an :class:`Engine` on this rank's
    slice of each batch and :func:`report` it; leave the group; exit with status 1 when any
    stage was wrong on any rank.

    Names of this script to use: ``parse_args()`` (its ``.stage``: a list of stages),
    ``build_model()``, ``Engine(model, stage, rank, world_size)`` (``.model``,
    ``.backward(loss)``, ``.step()``), ``batch(step)`` (the global batch x, y),
    ``my_slice(t, rank, world_size)``, ``STEPS``, ``report(engine, losses)`` (True when wrong).
    """
    # BEGIN SOLUTION
    stages = parse_args().stage
    dist.init_process_group("gloo")  # torchrun's environment says who, how many and where
    rank, world_size = dist.get_rank(), dist.get_world_size()
    failed = False
    for stage in stages:
        engine = Engine(build_model(), stage, rank, world_size)
        losses = []
        for step in range(STEPS):
            x, y = (my_slice(t, rank, world_size) for t in batch(step))
            loss = F.mse_loss(engine.model(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        failed = report(engine, losses) or failed
    dist.destroy_process_group()
    if failed:
        sys.exit(1)  # on every rank: torchrun reports the failure
    # END SOLUTION


if __name__ == "__main__":
    main()
