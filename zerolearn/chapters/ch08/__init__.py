"""Chapter 8, beyond the paper: ZeRO-Offload, ZeRO-Infinity and ZeRO++.

* notebook: ``notebooks/src/08_beyond.py``, built into ``notebooks/08_beyond.ipynb`` and
  the reader's copy ``notebooks/exercises/08_beyond.ipynb``;
* lesson: :mod:`.lesson`, the code the chapter runs and shows;
* exercise ``08.dpu_step`` (:mod:`.dpu_step`, checked by :mod:`.dpu_step_check`):
  ZeRO-Offload's one-step delayed parameter update, the end of a step that publishes
  the host's last finished update and starts this step's on a worker thread; checked in
  this process against a deterministic worker that makes an unfinished update visible;
* exercise ``08.quantized_all_gather`` (:mod:`.quantized_all_gather`, checked by
  :mod:`.quantized_all_gather_check`): ZeRO++'s qwZ, an all-gather of int8 values with
  one scale per block, on 2 and 3 gloo ranks.

Sources: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC 2021 (arXiv 2101.06840); Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory
Wall for Extreme Scale Deep Learning", SC'21 (arXiv 2104.07857); Wang et al., "ZeRO++:
Extremely Efficient Collective Communication for Giant Model Training" (arXiv 2306.10209).
"""
