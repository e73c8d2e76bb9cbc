"""Chapter 2, ZeRO-1 (P_os): partition the optimizer states (paper Sec 5.1; traffic: Sec 1, Sec 7).

* notebook: ``notebooks/src/02_zero1.py``, built into ``notebooks/02_zero1.ipynb`` and
  the reader's copy ``notebooks/exercises/02_zero1.ipynb``;
* lesson: :mod:`.lesson`, the runner of the chapter's comparisons on spawned ranks
  (``jobs``, ``train_naive``) and the naive ZeRO-1 that chapter 3 compares with (the
  chapter writes its own copy, and the whole-tensor splits, in its cells);
* exercise ``02.shard_range`` (:mod:`.shard_range`, checked by
  :mod:`.shard_range_check`): which elements of a flat buffer padded to a multiple of Nd
  a rank owns; checked on real ranks by gathering every rank's answer;
* exercise ``02.flatten_params`` (:mod:`.flatten_params`, checked by
  :mod:`.flatten_params_check`): a model's parameters made views of one flat buffer
  padded to a multiple of Nd, its gradients views of a flat twin that backward fills;
  checked on real ranks by three SGD steps taken through the buffers alone;
* exercise ``02.zero1_step`` (:mod:`.zero1_step`, checked by :mod:`.zero1_step_check`):
  one ZeRO-1 step on a flat gradient, in fp32 or bf16: reduce-scatter, Adam on this
  rank's fp32 master shard, all-gather of the updated parameters; checked against
  single-process Adam, the ledger's 2 Psi per step and the optimizer state kept
  (K Psi / Nd, K = 12: the master and Adam's two moments), and in bf16 against fp32 Adam
  on the master. ZeRO-2 and ZeRO-3 call the same step (``reduced=True``, ``gather=False``)
  in :mod:`zerolearn.nano`.
"""
