"""Chapter 6, at scale: the paper's tables from the formulas, measured where a CPU can.

* notebook: ``notebooks/src/06_at_scale.py``, built into ``notebooks/06_at_scale.ipynb``
  and the reader's copy ``notebooks/exercises/06_at_scale.ipynb``; its appendix, the
  memory explorer: ``notebooks/src/06a_memory_explorer.py``;
* lesson: :mod:`.lesson`, the code the chapter runs and shows;
* exercise ``06.max_psi`` (:mod:`.max_psi`, checked by :mod:`.max_psi_check`): the
  largest model whose model states fit a device, per stage, with model parallelism on
  top (Table 2's theoretical column, Sec 5);
* exercise ``06.fewest_gpus`` (:mod:`.fewest_gpus`, checked by
  :mod:`.fewest_gpus_check`): the fewest GPUs, then the lowest stage, that hold a model
  (the rule of :func:`zerolearn.memory.fit.smallest_fit`).

Both are checked in this process over a grid against :mod:`zerolearn.memory`, Table 2's
own rows first.
"""
