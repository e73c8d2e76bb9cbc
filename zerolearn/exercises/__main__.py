"""``python -m zerolearn.exercises``: list the exercises, check solutions and known bugs.

    python -m zerolearn.exercises list
    python -m zerolearn.exercises check 02.zero1_step --solution
    python -m zerolearn.exercises check 02.zero1_step --bug allreduce_then_allgather
    python -m zerolearn.exercises check --all --solution     # exit 0: every solution passes
    python -m zerolearn.exercises check --all --bugs         # exit 0: every known bug is caught
    python -m zerolearn.exercises times [NAME ...]           # seconds to a verdict, mistakes on one rank
    python -m zerolearn.exercises latency [NAME ...]         # seconds to an answer: skeleton, first, kept ranks

Exit status 0 when every check came out as expected (a solution passes; a bug is caught
with the words its entry says), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from zerolearn.errors import ConfigError
from zerolearn.exercises import EXERCISES, PROGRAMS, check, get, reusing_ranks


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (naming it and what is allowed) and exit 2."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zerolearn.exercises", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="every exercise, chapter first, one per line")
    t = sub.add_parser("times", help="seconds to a verdict for a mistake on one rank, per rank exercise")
    t.add_argument("names", nargs="*", metavar="NAME", help="rank exercises (default: all)")
    lat = sub.add_parser("latency", help="seconds to an answer per rank exercise: skeleton, first check, kept ranks")
    lat.add_argument("names", nargs="*", metavar="NAME", help="rank exercises (default: all)")
    c = sub.add_parser("check", help="run the checker on reference solutions or known bugs")
    c.add_argument("name", nargs="?", help="an exercise, e.g. 02.zero1_step")
    c.add_argument("--all", action="store_true", help="every exercise")
    what = c.add_mutually_exclusive_group(required=True)
    what.add_argument("--solution", action="store_true", help="check the reference solution (must pass)")
    what.add_argument("--bug", metavar="BUG", help="check one known bug of NAME (must be caught)")
    what.add_argument("--bugs", action="store_true", help="check every known bug (each must be caught)")
    return p


def _runs(args) -> list[tuple[str, str | None]]:
    """(exercise, bug or None) pairs to check; raises ConfigError on bad names."""
    if args.all == bool(args.name):
        raise ConfigError("check: give an exercise NAME or --all, not both or neither")
    names = sorted([*EXERCISES, *PROGRAMS]) if args.all else [get(args.name).name]
    if args.bug is not None:
        if args.all:
            raise ConfigError("check --all --bug BUG: a bug belongs to one exercise; use --bugs")
        if args.bug not in get(args.name).bugs:
            raise ConfigError(f"--bug {args.bug!r} of {args.name}: allowed are {', '.join(get(args.name).bugs)}")
        return [(args.name, args.bug)]
    if args.bugs:
        return [(n, b) for n in names for b in get(n).bugs]
    return [(n, None) for n in names]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        for name in sorted([*EXERCISES, *PROGRAMS]):
            print(f"{name:28} {get(name).title}")
        return 0
    try:
        if args.command == "latency":
            from zerolearn.exercises import timing

            ranked = sorted(n for n in EXERCISES if EXERCISES[n].world_sizes)
            for name in args.names:
                if name not in ranked:
                    raise ConfigError(f"latency {name!r}: allowed are the rank exercises {', '.join(ranked)}")
            rows = timing.latency(args.names or None)
            return 0 if all(ok for *_, ok in rows) else 1
        if args.command == "times":
            from zerolearn.exercises import timing

            ranked = sorted(n for n in EXERCISES if EXERCISES[n].world_sizes and EXERCISES[n].bugs)
            for name in args.names:
                if name not in ranked:
                    raise ConfigError(f"times {name!r}: allowed are the rank exercises {', '.join(ranked)}")
            timing.time_to_verdict(args.names or None)
            return 0
        runs = _runs(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = []
    with reusing_ranks():
        for name, bug in runs:
            _one(name, bug, failed)
    print(f"{len(runs) - len(failed)} of {len(runs)} as expected" + (f"; not: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _one(name: str, bug: str | None, failed: list[str]) -> None:
    """Check ``name``'s solution (``bug`` None) or one of its bugs; append it to ``failed`` if
    it did not come out as expected."""
    if bug is None:
        ok = bool(check(name, solution=True))
    else:
        says = get(name).bugs[bug].says
        result = check(name, bug=bug, quiet=True)
        ok = not result.passed and result.written and says in str(result)
        print(f"{name} --bug {bug}: {'caught' if ok else 'NOT CAUGHT as expected'}: {result}")
    if not ok:
        failed.append(f"{name}{' --bug ' + bug if bug else ''}")


if __name__ == "__main__":
    sys.exit(main())
