"""Chapter 0, the memory wall: where training memory goes (paper Sec 3).

* notebook: ``notebooks/src/00_memory_wall.py``, built into
  ``notebooks/00_memory_wall.ipynb`` and the reader's copy
  ``notebooks/exercises/00_memory_wall.ipynb``;
* lesson: :mod:`.lesson`, the walk over autograd's saved tensors behind the chapter's
  table of a block's activations, the largest batch with all residual states counted, and
  the layout of two figures;
* exercise ``00.model_state_bytes`` (:mod:`.model_state_bytes`, checked by
  :mod:`.model_state_bytes_check`): the bytes of parameters, gradients and optimizer
  states of one replica, (2 + 2 + K) Psi in mixed precision (Sec 3.1), for Adam and SGD,
  in fp32, bf16 and fp16;
* exercise ``00.max_batch`` (:mod:`.max_batch`, checked by :mod:`.max_batch_check`): the
  largest batch whose activations (Sec 3.2) fit beside the model states on one device.

Both are checked in this process over a grid of cases against
:mod:`zerolearn.memory.model`, and a message names the case, the quantity and what the
paper's accounting gives.
"""
