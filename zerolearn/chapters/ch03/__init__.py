"""Chapter 3, ZeRO-2 (P_os+g): partition the gradients too (paper Sec 5.2).

* notebook: ``notebooks/src/03_zero2.py``, built into ``notebooks/03_zero2.ipynb`` and
  the reader's copy ``notebooks/exercises/03_zero2.ipynb``;
* lesson: :mod:`.lesson`, the accumulation comparison the chapter runs on spawned ranks
  (the blog's ZeRO-2 is written in the chapter's cells);
* exercise ``03.reduce_scatter_hook`` (:mod:`.reduce_scatter_hook`, checked by
  :mod:`.reduce_scatter_hook_check`): once backward has made every gradient of a bucket,
  reduce-scatter the bucket into this rank's shard (the average over ranks) and free the
  full gradients;
* exercise ``03.accumulate`` (:mod:`.accumulate`, checked by :mod:`.accumulate_check`):
  reduce one micro-batch's bucket and add it into the shard, so that after the step's
  last micro-batch the shard holds the step's mean gradient.

Both trials train the book's MLP (4 square Linear layers of width 64, 16,640 fp32
parameters; at 3 ranks every bucket is padded) with SGD on 2 and 3 ranks, and compare
every step's gradient shards with single-process training on the same global batch
(:mod:`zerolearn.exercises.helpers`).
"""
