"""Chapter 7, in practice: PyTorch, DeepSpeed, and choosing a stage.

* notebook: ``notebooks/src/07_in_practice.py``, built into
  ``notebooks/07_in_practice.ipynb`` and the reader's copy
  ``notebooks/exercises/07_in_practice.ipynb``;
* lesson: :mod:`.lesson`, the code the chapter runs and shows;
* exercise ``07.stage_from_bytes`` (:mod:`.stage_from_bytes`, checked by
  :mod:`.stage_from_bytes_check`): which ZeRO stage an implementation runs, read from
  the bytes one of its ranks holds beside a full replica's (how the chapter tells what
  DDP, ZeroRedundancyOptimizer and FSDP2 shard);
* exercise ``07.choose_stage`` (:mod:`.choose_stage`, checked by
  :mod:`.choose_stage_check`): the lowest stage whose model states fit the GPUs you have
  once the residual states (activations, buffers; Sec 3.2) are budgeted.

Both are checked in this process over cases built from :mod:`zerolearn.memory` (padded
and whole-tensor shards included), with messages that name the case and the state that
decides it.
"""
