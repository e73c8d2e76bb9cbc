"""torchrun for ``zerolearn.train``, with the exit codes of a single process.

torchrun exits 1 whenever a worker fails, so a bad option that ``python -m
zerolearn.train`` refuses with exit 2 would exit 1 under torchrun. This launcher takes
torchrun's own options, then ``--``, then the training options::

    python -m zerolearn.launch --nproc-per-node 4 -- --stage 3 --report run.json

It checks the training options for the whole world (``--nnodes`` x
``--nproc-per-node`` ranks) before starting any worker, starts them with torchrun's
machinery (``torch.distributed.run``), and exits with the workers' code: 0 done, 2
bad input, 130 Ctrl-C, 1 anything else (workers that torchrun stops by a signal after
another failed do not count). See
``zerolearn.train.main`` for what each code means.
"""

from __future__ import annotations

import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from zerolearn.config import TrainConfig, build_parser
from zerolearn.dist import ConfigError


def _world_size(args) -> int | None:
    """Ranks of the job when ``--nnodes`` is fixed (``N`` or ``N:N``); None if elastic."""
    low, _, high = str(args.nnodes).partition(":")
    if high and high != low:
        return None
    nproc = args.nproc_per_node
    return int(low) * int(nproc) if str(nproc).isdigit() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    run_argv, train_argv = argv[:split], argv[split + 1:]
    args = torchrun.get_args_parser().parse_args([*run_argv, "-m", "zerolearn.train", *train_argv])
    options = TrainConfig.from_argv(train_argv)  # exits 2 naming a bad option
    world = _world_size(args)
    if world is not None:
        try:
            options.validate(world)
        except ConfigError as e:
            parser = build_parser()
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    config, cmd, cmd_args = torchrun.config_from_args(args)
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        # Workers that exited decide; torchrun stops the rest by a signal (negative codes).
        exited = {failure.exitcode for failure in e.failures.values() if failure.exitcode >= 0}
        return exited.pop() if len(exited) == 1 and exited <= {2, 130} else 1
    except (KeyboardInterrupt, SignalException):
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
