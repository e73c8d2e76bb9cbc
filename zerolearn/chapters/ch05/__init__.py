"""Chapter 5, ZeRO-R: the memory that is left (paper Sec 6.1-6.3).

The chapter's exercises, each the reader's function (``<name>.py``) beside its check
(``<name>_check.py``):

* ``05.partition_checkpoint``: P_a (Sec 6.1). Each of the Nm model-parallel ranks
  keeps 1/Nm of a block's checkpoint and hands back a function that all-gathers the
  whole of it before the block is recomputed;
* ``05.constant_buffer``: CB (Sec 6.2). Average many gradients over the ranks through
  one fused buffer of a fixed size, fill after fill, so no buffer grows with the model.

``05.partition_checkpoint``'s gradients are compared with plain training in one
process, its bytes with the memory ledger; ``05.constant_buffer`` reduces the gradients
of two MLPs of different sizes through the same 1,024-element buffer.
"""
