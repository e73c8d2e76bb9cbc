"""Chapter 1, data parallelism from scratch (paper Sec 2.1, Sec 7.1).

* notebook: ``notebooks/src/01_data_parallelism.py``, built into
  ``notebooks/01_data_parallelism.ipynb`` and the reader's copy
  ``notebooks/exercises/01_data_parallelism.ipynb``;
* lesson: :mod:`.lesson`, the layout of the chapter's collectives and redundancy figures;
* exercise ``01.average_gradients`` (:mod:`.average_gradients`, checked by
  :mod:`.average_gradients_check`): after backward, replace every gradient by its mean
  over the ranks, one all-reduce per tensor (naive DP);
* exercise ``01.bucket_hook`` (:mod:`.bucket_hook`, checked by
  :mod:`.bucket_hook_check`): the same mean, in buckets launched from autograd hooks
  while backward runs, as DDP and the book's engines do (the scheme Sec 5.2 builds on).

Both trials train a small GPT with Adam (:mod:`zerolearn.exercises.helpers`) against one
process on the whole batch.
"""
