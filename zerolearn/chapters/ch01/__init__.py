"""Chapter 1, data parallelism from scratch (paper Sec 2.1, Sec 7.1).

The chapter's exercises, each the reader's function (``<name>.py``) beside its check
(``<name>_check.py``):

* ``01.average_gradients``: after backward, replace every gradient by its mean over
  the ranks, one all-reduce per tensor (naive DP);
* ``01.bucket_hook``: the same mean, in buckets launched from autograd hooks while
  backward runs, as DDP and the book's engines do (the scheme Sec 5.2 builds on).

Both trials train a small GPT with Adam (:mod:`zerolearn.exercises.helpers`) against one
process on the whole batch.
"""
