"""Run several bad command lines of ``python -m zerolearn.train`` in one process, importing
torch once: ``python tests/cli_driver.py CASES.json`` prints, for each ``[args, env]`` of the
file, ``[exit code, stderr]`` as JSON on its last line. Each case runs ``zerolearn.cli.main``
as ``python -m zerolearn.train`` would (an exit through ``SystemExit`` gives its code), with
its environment variables set for it alone; a case that leaves a process group behind fails."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch.distributed as dist

from zerolearn.cli import main


def run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    if dist.is_initialized():
        return 99, err.getvalue() + "\na process group was left initialised"
    return code, err.getvalue()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print(json.dumps([run(args, env) for args, env in cases]))
