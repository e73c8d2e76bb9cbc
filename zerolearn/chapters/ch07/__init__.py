"""Chapter 7, in practice: PyTorch, DeepSpeed, and choosing a stage.

The chapter's exercises, each the reader's function (``<name>.py``) beside its check
(``<name>_check.py``):

* ``07.stage_from_bytes``: which ZeRO stage an implementation runs, read from the
  bytes one of its ranks holds beside a full replica's (how the chapter tells what
  DDP, ZeroRedundancyOptimizer and FSDP2 shard);
* ``07.choose_stage``: the lowest stage whose model states fit the GPUs you have once
  the residual states (activations, buffers; Sec 3.2) are budgeted.

Both are checked in this process over cases built from :mod:`zerolearn.memory` (padded
and whole-tensor shards included), with messages that name the case and the state that
decides it.
"""
