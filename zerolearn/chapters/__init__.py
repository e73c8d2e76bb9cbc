"""The book's chapters, one folder each (``ch00`` to ``ch08``): what a chapter's notebook
calls and what its reader writes.

A chapter's notebook is built from its source in ``notebooks/src/`` (``NN_name.py``,
see ``notebooks/build.py``); its folder here holds the rest, and its ``__init__``
names every file:

* ``lesson.py``: only what other code reuses (a simulation a later chapter runs again, a
  list the tests import). What a chapter runs once, its experiments and naive versions,
  is defined in the notebook's own cells, where the reader reads it; ``launch`` sends
  such functions to the spawned ranks by value. Package code is shown as an excerpt of
  at most 15 lines (:func:`zerolearn.chapters.source.excerpt`), never printed whole.
* one pair of files per exercise. The reader's part, ``<name>.py``, is exactly what the
  reader writes: the function's signature and docstring and, between ``# BEGIN
  SOLUTION`` and ``# END SOLUTION``, the reference solution (the reader's copy of the
  chapter has ``raise NotImplementedError`` there). Its check, ``<name>_check.py``,
  holds the trial that runs the reader's function, the known bugs of its kind and the
  exercise's registration. The checker, :mod:`zerolearn.exercises`, imports every check.

Shared by chapters 1-4: :mod:`zerolearn.chapters.your_engine`, where the reader's
functions, assembled into :class:`zerolearn.nano.NanoZero`, train beside one process.

The results some chapters draw instead of measuring them again (DeepSpeed's stages,
the benchmarks) are recorded under ``notebooks/data/`` and read with :func:`stored`.

The reader writes torch 2.13's collective names (``dist.reduce_scatter_single``,
``dist.all_gather_single``); importing any chapter imports :mod:`zerolearn.compat`, which
gives torch 2.11 those names too.
"""

import json
from pathlib import Path

from zerolearn import compat  # noqa: F401 - torch 2.13's collective names on torch 2.11

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
