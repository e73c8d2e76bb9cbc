"""Chapter 5, ZeRO-R: the memory that is left (paper Sec 6.1-6.3).

* notebook: ``notebooks/src/05_zero_r.py``, built into ``notebooks/05_zero_r.ipynb`` and
  the reader's copy ``notebooks/exercises/05_zero_r.ipynb``;
* lesson: :mod:`.lesson`, the runs the chapter measures;
* exercise ``05.tensor_parallel`` (:mod:`.tensor_parallel`, checked by
  :mod:`.tensor_parallel_check`): Megatron's column- and row-parallel Linear layers and
  their two autograd functions (identity forward / all-reduce backward, and the reverse),
  checked on Nm = 2 and on Nd x Nm = 2 x 2 ranks against the whole block in one process
  (Sec 8; :mod:`zerolearn.residual.tensor_parallel` is the package's own);
* exercise ``05.partition_checkpoint`` (:mod:`.partition_checkpoint`, checked by
  :mod:`.partition_checkpoint_check`): P_a (Sec 6.1). Each of the Nm model-parallel
  ranks keeps 1/Nm of a block's checkpoint and hands back a function that all-gathers
  the whole of it before the block is recomputed;
* exercise ``05.constant_buffer`` (:mod:`.constant_buffer`, checked by
  :mod:`.constant_buffer_check`): CB (Sec 6.2). Average many gradients over the ranks
  through one fused buffer of a fixed size, fill after fill, so no buffer grows with the
  model.

``05.partition_checkpoint``'s gradients are compared with plain training in one process,
its bytes with the memory ledger; ``05.constant_buffer`` reduces the gradients of two
MLPs of different sizes through the same 1,024-element buffer.
"""
