"""Chapter 03's exercises: ZeRO-2's gradient path (paper Sec 5.2).

* ``03.reduce_scatter_hook`` (:mod:`.reduce_scatter_hook`): once backward has made
  every gradient of a bucket, reduce-scatter the bucket into this rank's shard (the
  average over ranks) and free the full gradients.
* ``03.accumulate`` (:mod:`.accumulate`): reduce one micro-batch's bucket and add it
  into the shard, so that after the step's last micro-batch the shard holds the step's
  mean gradient.

Both trials train the book's MLP (4 square Linear layers of width 64, 16,640 fp32
parameters; at 3 ranks every bucket is padded) with SGD on 2 and 3 ranks, and compare
every step's gradient shards with single-process training on the same global batch
(:mod:`zerolearn.exercises.helpers`). Importing this package registers both.
"""

from zerolearn.exercises.ch03 import accumulate, reduce_scatter_hook  # noqa: F401 - they register
