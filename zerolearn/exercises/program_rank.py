"""One rank of a program exercise: runs the reader's script as ``__main__`` under torchrun
and writes what the rank did to ``OUT/rank<RANK>.json``.

    python -m torch.distributed.run --standalone --nproc-per-node N program_rank.py OUT SCRIPT [ARG ...]

Started by path (not ``-m``), so a rank imports torch and nothing of zerolearn. While the
script runs (with the ARGs as its command line), torch.distributed's collectives are counted (in call order),
``init_process_group`` gets a timeout of ``ZEROLEARN_PROGRAM_TIMEOUT_S`` seconds where
the script gives none (a collective its peers never call fails, not hangs), and what the
script prints is kept. The JSON holds: ``printed`` (lines), ``calls`` (collective names in
order), ``backend`` (of the first ``init_process_group``, or None), ``destroyed`` (whether
the script called ``destroy_process_group``), ``open_at_end`` (a group still initialised
when the script returned), ``error`` (None, or type, words and the script's line) and
``stderr`` (its last lines). The rank exits 0 whatever the script did, so torchrun lets
the other ranks finish and report.
"""

import io
import json
import os
import runpy
import sys
import traceback
from datetime import timedelta

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "send", "recv", "isend", "irecv", "barrier", "all_gather_object",
               "broadcast_object_list")


def _watch(record: dict) -> None:
    """Wrap torch.distributed's names so a call is recorded before it runs."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            record["calls"].append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if record["backend"] is None:
            record["backend"] = str(backend) if backend is not None else "default"
        kwargs.setdefault("timeout", timedelta(seconds=float(os.environ.get("ZEROLEARN_PROGRAM_TIMEOUT_S", "20"))))
        return init(backend, *args, **kwargs)

    def destroy_process_group(*args, **kwargs):
        record["destroyed"] = True
        return destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group


def _error(e: BaseException, script: str) -> dict:
    """The exception's type and words, and the deepest line of ``script`` it passed through."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == script]
    where = frames[-1] if frames else None
    return {"type": type(e).__name__, "words": str(e).strip().splitlines()[0] if str(e).strip() else "",
            "line": where.lineno if where else None, "text": (where.line or "").strip() if where else ""}


def main(out: str, script: str, args: list[str]) -> None:
    script = os.path.abspath(script)
    record = {"printed": [], "calls": [], "backend": None, "destroyed": False, "open_at_end": False,
              "error": None, "stderr": ""}
    _watch(record)
    printed, errors = io.StringIO(), io.StringIO()
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = printed, errors
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            record["error"] = {"type": "SystemExit", "words": f"exit status {e.code}", "line": None, "text": ""}
    except BaseException as e:  # noqa: BLE001 - whatever the script raised is the verdict
        record["error"] = _error(e, script)
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    record["open_at_end"] = dist.is_initialized()
    record["printed"] = printed.getvalue().splitlines()
    record["stderr"] = "\n".join(errors.getvalue().splitlines()[-5:])
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    if record["open_at_end"]:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
