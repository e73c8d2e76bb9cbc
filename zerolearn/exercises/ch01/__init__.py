"""Chapter 01's exercises: data parallelism on real ranks (paper Sec 2.1, Sec 7.1).

* ``01.average_gradients`` (:mod:`.average_gradients`): after backward, replace every
  gradient by its mean over the ranks, one all-reduce per tensor (naive DP).
* ``01.bucket_hook`` (:mod:`.bucket_hook`): the same mean, in buckets launched from
  autograd hooks while backward runs, as DDP and the book's engines do (the scheme
  Sec 5.2 builds on).

Both trials train a small GPT with Adam (:mod:`zerolearn.exercises.helpers`) against one
process on the whole batch. Importing this package registers both.
"""

from zerolearn.exercises.ch01 import average_gradients, bucket_hook  # noqa: F401 - they register
