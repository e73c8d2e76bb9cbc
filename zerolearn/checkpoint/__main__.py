"""``python -m zerolearn.checkpoint``: inspect and consolidate checkpoints.

    python -m zerolearn.checkpoint consolidate DIR OUT   # fp32 state_dict for the plain model
    python -m zerolearn.checkpoint info DIR              # step, stage, world size, sizes

DIR is a checkpoint (``step_NNNNNNNN``) or a folder of them (the newest complete one
is used). Both commands first verify every shard against the manifest (size and
SHA-256); a checkpoint saved without checksums is accepted with a note that only
sizes were checked. Exit codes: 0 done, 2 bad or damaged input (the message names the
file and the field or what differs; ``consolidate`` then writes nothing; an OUT inside
any checkpoint directory, or a folder, is refused the same way before anything is
read), 1 other (e.g. OUT cannot be written).
"""

from __future__ import annotations

import argparse
import sys

from zerolearn.checkpoint import CheckpointError, consolidate, resolve, verify
from zerolearn.checkpoint.checksums import NO_CHECKSUMS
from zerolearn.checkpoint.files import check_out, read_manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolearn.checkpoint", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one full-precision state_dict (torch.save) to OUT, a file "
                                           "outside every checkpoint directory")
    c.add_argument("dir")
    c.add_argument("out")
    i = sub.add_parser("info", help="print the manifest's summary")
    i.add_argument("dir")
    args = p.parse_args(argv)
    try:
        if args.command == "consolidate":
            check_out(args.out, (args.dir,))  # before anything is read
        path = resolve(args.dir)
        man = read_manifest(path, check_files=False)  # verify (consolidate does) checks the files
        files = f"{len(man.files)} files" + (", SHA-256 verified" if man.checksums else f" ({NO_CHECKSUMS})")
        if args.command == "consolidate":
            state = consolidate(path, args.out)  # verifies every shard first
            numel = sum(t.numel() for k, t in state.items() if k not in man.aliases)
            print(f"{path}: step {man.step}, stage {man.stage}, {man.world_size} rank(s) -> {args.out}: "
                  f"{len(state)} tensors, {numel:,} elements, {numel * 4 / 2**20:.2f} MiB fp32 ({files})")
        else:
            verify(path, man)
            total = sum(f.bytes for f in man.files)
            print(f"{path}: step {man.step}, stage {man.stage}, world size {man.world_size}, "
                  f"{man.optimizer} ({', '.join(man.state_keys) or 'no state yet'}), {man.dtype}, "
                  f"{len(man.params)} parameters, {total / 2**20:.2f} MiB in {files}")
    except CheckpointError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    except OSError as e:
        p.exit(1, f"{p.prog}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
