"""Code the chapters build step by step and run on spawned ranks.

Spawned processes import the function they run by name, so what a notebook
launches lives here, one module per chapter, and the notebook shows it with
``inspect.getsource``. The naive versions are lessons, not engines: the package's
engines (``zerolearn.engines``) keep only the real ones.
"""

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "notebooks" / "data"
"""Results the chapters draw from, recorded by ``make`` targets (``make deepspeed``, ``make bench``)."""


def stored(name: str) -> dict:
    """The stored results ``notebooks/data/<name>`` (JSON), wherever the notebook runs from
    (a chapter in ``notebooks/`` or its reader's copy in ``notebooks/exercises/``).

    Raises:
        FileNotFoundError: no such file; the message names the make target that writes it.
    """
    path = DATA / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not recorded here; the make target that writes it (make deepspeed, "
                                "make bench) records it")
    return json.loads(path.read_text())
