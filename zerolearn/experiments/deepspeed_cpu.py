"""DeepSpeed's own ZeRO stages on chapter 7's job, for the chapter's side-by-side table.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 -m zerolearn.experiments.deepspeed_cpu \\
        --stage 3 --out notebooks/data/deepspeed_cpu.json

or ``make deepspeed``, which installs DeepSpeed into the project's environment
(``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed``: no compiled ops, which
ZeRO stages 0-3 do not need) and runs all four stages. Each stage trains the GPT of
:mod:`zerolearn.chapters.ch07.lesson` on the same global batches, with the same Adam, under
``deepspeed.initialize`` with ``ch07.DEEPSPEED_CONFIG[stage]`` on gloo, and rank 0
adds ``"deepspeed, stage S"`` to the JSON file ``--out``: ``losses`` (global mean per
step), ``step_s`` (median step time, seconds), ``bytes`` per rank counted from
tensors (``params``: the module's parameters, or for stage 3 this rank's partition;
``master``: fp32 copies the ZeRO optimizer keeps beside the parameters;
``optimizer_states``: Adam's moments this rank holds) and ``deepspeed`` (its version).

The config sets ``"gradient_clipping": 0.0``: from DeepSpeed 0.19.3 on, it clips the
global gradient norm at 1.0 unless told otherwise (before, its default was 0.0, no
clipping), and with that default the losses part from every other implementation's at
the third step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from zerolearn import comm
from zerolearn import dist as zdist
from zerolearn.chapters.ch07 import lesson as ch07
from zerolearn.models import build_model


def config(stage: int, world_size: int) -> dict:
    """The DeepSpeed config of our ``stage`` for ``world_size`` ranks (fp32, Adam, no clipping)."""
    return {"train_micro_batch_size_per_gpu": ch07.BATCH // world_size, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": ch07.LR, "torch_adam": True, "adam_w_mode": False,
                                                     "weight_decay": 0.0}},
            "gradient_clipping": 0.0, "steps_per_print": 10**9, **ch07.DEEPSPEED_CONFIG[stage]}


def run(stage: int, steps: int = 4) -> dict:
    """Train ``steps`` steps with DeepSpeed's ``stage`` on the current process group."""
    import deepspeed

    rank, world_size = zdist.context().rank, zdist.context().world_size
    model = build_model("gpt", 0, gpt=ch07.GPT)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(stage, world_size))
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = ch07._batch(step)
        loss = ch07._loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(comm.monitor_mean(loss.item()))
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]  # stage 3: the partition
    inner = getattr(optimizer, "optimizer", optimizer)  # a ZeRO optimizer wraps torch's Adam
    stepped = [p for group in inner.param_groups for p in group["params"]]
    param_bytes = ch07._local_bytes(params)
    # Storages are counted once, so what the optimizer steps on beyond the parameters is its own copy.
    master = ch07._local_bytes(params + stepped) - param_bytes
    return {"losses": losses, "step_s": statistics.median(times), "deepspeed": deepspeed.__version__,
            "world_size": world_size, "rank": rank,
            "bytes": {"params": param_bytes, "master": master,
                      "optimizer_states": ch07._local_bytes(ch07._optimizer_tensors(inner))}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m zerolearn.experiments.deepspeed_cpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=range(4), required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True, help="JSON file to add this stage's results to")
    args = p.parse_args(argv)
    try:
        import deepspeed
    except ImportError:
        p.exit(2, f"{p.prog}: error: deepspeed is not installed; "
                  "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed (or: make deepspeed)\n")
    if "RANK" not in os.environ:
        p.exit(2, f"{p.prog}: error: run me under torchrun (with DS_ACCELERATOR=cpu on a machine without GPUs)\n")
    zdist.init("auto", "auto")  # our process group (with its timeout); DeepSpeed adopts it
    deepspeed.init_distributed(dist_backend=zdist.context().backend)
    result = run(args.stage, args.steps)
    if result["rank"] == 0:
        done = json.loads(open(args.out).read()) if os.path.exists(args.out) else {}
        done[f"deepspeed, stage {args.stage}"] = result
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(done, f, indent=1, sort_keys=True)
        print(f"deepspeed {result['deepspeed']} stage {args.stage}: losses {result['losses']}")
    zdist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
