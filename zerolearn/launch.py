"""torchrun for ``zerolearn.train``, with the exit codes of a single process.

torchrun exits 1 whenever a worker fails, so a bad option that ``python -m
zerolearn.train`` refuses with exit 2 would exit 1 under torchrun. This launcher takes
torchrun's own options, then ``--``, then the training options::

    python -m zerolearn.launch --nproc-per-node 4 -- --stage 3 --report run.json
    python -m zerolearn.launch --standalone --nproc-per-node 4 -- --stage 3

On one node no rendezvous option is needed: as with ``torchrun --standalone``, the
workers meet at a store on a free port of this machine (``--master-port``,
``--rdzv-endpoint`` and the other rendezvous options of torchrun are honoured when
given). It checks the launcher's and the training options for the whole world
(``--nnodes`` x ``--nproc-per-node`` ranks) before starting any worker, starts them
with torchrun's machinery (``torch.distributed.run``), and exits with the workers'
code: 0 done, 2 bad input, 130 Ctrl-C (SIGINT), 143 SIGTERM, 1 anything else
(workers that torchrun stops by a signal after another failed do not count, whether
they die of it or answer it with 143: :func:`exit_code`). On SIGINT or SIGTERM
torchrun passes the signal on to the workers, whose rank 0 prints one line naming it
and the last checkpoint; before any worker has started (a rendezvous waiting for the
other nodes) the launcher prints that line itself. See ``zerolearn.cli.main`` for
what each code means.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from zerolearn.config import TrainConfig, build_parser
from zerolearn.dist import ConfigError

PROG = "python -m zerolearn.launch"
EXIT_ON_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number


def _world_size(args) -> int | None:
    """Ranks of the job when ``--nnodes`` is fixed (``N`` or ``N:N``); None if elastic."""
    low, _, high = str(args.nnodes).partition(":")
    if high and high != low:
        return None
    nproc = args.nproc_per_node
    return int(low) * int(nproc) if str(nproc).isdigit() else None


def _refuse(message: str) -> None:
    """Exit 2 with argparse's ``prog: error: message`` line."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _rendezvous(args) -> None:
    """Set what ``torchrun`` itself sets before it launches (``torch.distributed.run.run``):
    ``--standalone``, or no rendezvous option on a single node, is a c10d store on a
    free local port; a static rendezvous without ``--master-port`` uses 29500."""
    one_node = torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and one_node):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _parse(run_argv: list[str], train_argv: list[str]):
    """torchrun's namespace and the checked training options; exits 2 on anything bad."""
    parser = torchrun.get_args_parser()
    parser.prog = PROG
    args = parser.parse_args([*run_argv, "-m", "zerolearn.train", *train_argv])
    options = TrainConfig.from_argv(train_argv)  # exits 2 naming a bad option
    try:
        low, high = torchrun.parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        _refuse(f"--nnodes {args.nnodes}: allowed are N or MIN:MAX, integers >= 1")
    if not 0 < low <= high:
        _refuse(f"--nnodes {args.nnodes}: allowed are N or MIN:MAX with 1 <= MIN <= MAX")
    nproc = str(args.nproc_per_node)
    if nproc not in ("auto", "cpu", "gpu", "xpu") and not (nproc.isdigit() and 0 < int(nproc) < 2**16):
        _refuse(f"--nproc-per-node {nproc}: allowed are an integer from 1 to 65535, auto, cpu or gpu")
    if args.max_restarts < 0:
        _refuse(f"--max-restarts {args.max_restarts}: must be an integer >= 0")
    if args.master_port is not None and not 0 < args.master_port < 2**16:
        _refuse(f"--master-port {args.master_port}: allowed are 1 to 65535")
    world = _world_size(args)
    if world is not None:
        try:
            options.validate(world)
        except ConfigError as e:
            parser = build_parser()
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    _rendezvous(args)
    return args, options


class _StoppedEarly(BaseException):  # noqa: N818 - like KeyboardInterrupt: no "except Exception" in torch keeps it
    def __init__(self, sigval: signal.Signals):
        super().__init__(sigval.name)
        self.sigval = sigval


def _before_workers(signum, frame) -> None:
    """SIGINT and SIGTERM before torchrun starts the workers (during the rendezvous with the
    other nodes): torchrun installs its own handler only when it starts them, and the
    default action would end this process without a word."""
    raise _StoppedEarly(signal.Signals(signum))


def exit_code(failures: dict) -> int:
    """The launcher's exit code from torchrun's failed workers (``ChildFailedError.failures``:
    each with its ``exitcode``): 2 when some worker refused bad input (exit 2: nothing else
    exits 2, so that is the cause, whatever the others did), 1 when some worker failed in
    any other way, else the 130 or 143 the workers answered a signal with. Workers that torchrun
    stopped once one had failed exit by a signal (a negative code) or, zerolearn.train's
    answer to SIGTERM, 143: they do not decide, however the race between their own exit and
    torchrun's signal went."""
    codes = [failure.exitcode for failure in failures.values()]
    own = {code for code in codes if code > 0 and code not in EXIT_ON_SIGNAL.values()}
    if 2 in own:
        return 2
    if own:
        return 1
    stopped = {code for code in codes if code in EXIT_ON_SIGNAL.values()}
    return stopped.pop() if len(stopped) == 1 else 1


def run(config, cmd, cmd_args: list[str]) -> int:
    """Run torchrun's agent with ``config`` on the workers ``cmd cmd_args``; the exit code
    (:func:`exit_code`). SIGINT or SIGTERM before the workers start prints one line naming
    the signal and exits 130 or 143."""
    # torchrun's agent logs each worker it stops by a signal; the exit code and the
    # workers' own line say what happened.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.ERROR)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _before_workers) for sig in EXIT_ON_SIGNAL} if main_thread else {}
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except _StoppedEarly as e:
        print(f"{PROG}: stopped by {e.sigval.name} during rendezvous, before any worker started "
              f"(--nnodes {config.min_nodes}:{config.max_nodes}, --rdzv-endpoint "
              f"{config.rdzv_endpoint or 'none'})", file=sys.stderr)
        return EXIT_ON_SIGNAL[e.sigval]
    except ChildFailedError as e:
        return exit_code(e.failures)
    except SignalException as e:
        return EXIT_ON_SIGNAL.get(e.sigval, 128 + int(e.sigval))
    except KeyboardInterrupt:
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    run_argv, train_argv = argv[:split], argv[split + 1:]
    args, _ = _parse(run_argv, train_argv)
    try:
        config, cmd, cmd_args = torchrun.config_from_args(args)
    except (AssertionError, ValueError) as e:
        _refuse(str(e))
    return run(config, cmd, cmd_args)


if __name__ == "__main__":
    sys.exit(main())
