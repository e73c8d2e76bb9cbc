"""Chapter 1, data parallelism from scratch (paper Sec 2.1, Sec 7.1).

* notebook: ``notebooks/src/01_data_parallelism.py``, built into
  ``notebooks/01_data_parallelism.ipynb`` and the reader's copy
  ``notebooks/exercises/01_data_parallelism.ipynb``;
* lesson: :mod:`.lesson`, the layout of the chapter's collectives and redundancy figures;
* exercise ``01.allreduce`` (a whole script, :mod:`.allreduce`, checked by
  :mod:`.allreduce_check` under torchrun): read the rank and world size from torchrun's
  environment, join the process group, one all-reduce, leave the group;
* exercise ``01.broadcast_model`` (:mod:`.broadcast_model`, checked by
  :mod:`.broadcast_model_check`): DDP's start-up, rank 0's parameters and buffers
  broadcast to every rank, in place;
* exercise ``01.average_gradients`` (:mod:`.average_gradients`, checked by
  :mod:`.average_gradients_check`): after backward, replace every gradient by its mean
  over the ranks, one all-reduce per tensor (naive DP);
* exercise ``01.bucket_hook`` (:mod:`.bucket_hook`, checked by
  :mod:`.bucket_hook_check`): the same mean, in buckets launched from autograd hooks
  while backward runs, as DDP and the book's engines do (the scheme Sec 5.2 builds on).

The last two trials train a small GPT with Adam (:mod:`zerolearn.exercises.helpers`) against one
process on the whole batch.
"""
