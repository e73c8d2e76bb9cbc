"""Chapter 0, the memory wall: where training memory goes (paper Sec 3).

The chapter's exercises, each the reader's function (``<name>.py``) beside its check
(``<name>_check.py``):

* ``00.model_state_bytes``: the bytes of parameters, gradients and optimizer states of
  one replica, (2 + 2 + K) Psi in mixed precision (Sec 3.1), for Adam and SGD, in
  fp32, bf16 and fp16;
* ``00.max_batch``: the largest batch whose activations (Sec 3.2) fit beside the
  model states on one device.

Both are checked in this process over a grid of cases against
:mod:`zerolearn.memory.model`, and a message names the case, the quantity and what the
paper's accounting gives.
"""
