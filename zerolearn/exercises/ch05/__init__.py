"""Chapter 05's exercises: ZeRO-R's partitioned checkpoints and constant buffers (paper Sec 6.1, 6.2).

* ``05.partition_checkpoint`` (:mod:`.partition_checkpoint`): P_a. Each of the Nm
  model-parallel ranks keeps 1/Nm of a block's checkpoint and hands back a function
  that all-gathers the whole of it before the block is recomputed.
* ``05.constant_buffer`` (:mod:`.constant_buffer`): CB. Average many gradients over the
  ranks through one fused buffer of a fixed size, fill after fill, so no buffer grows
  with the model.

``05.partition_checkpoint``'s gradients are compared with plain training in one
process, its bytes with the memory ledger; ``05.constant_buffer`` reduces the gradients
of two MLPs of different sizes through the same 1,024-element buffer. Importing this
package registers both.
"""

from zerolearn.exercises.ch05 import constant_buffer, partition_checkpoint  # noqa: F401 - they register
