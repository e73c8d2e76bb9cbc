"""Chapter 6, at scale: the paper's tables from the formulas, measured where a CPU can.

The chapter's exercises, each the reader's function (``<name>.py``) beside its check
(``<name>_check.py``):

* ``06.max_psi``: the largest model whose model states fit a device, per stage, with
  model parallelism on top (Table 2's theoretical column, Sec 5);
* ``06.fewest_gpus``: the fewest GPUs, then the lowest stage, that hold a model (the
  rule of :func:`zerolearn.memory.fit.smallest_fit`).

Both are checked in this process over a grid against :mod:`zerolearn.memory`, Table 2's
own rows first.
"""
