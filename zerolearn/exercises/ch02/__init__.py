"""Chapter 02's exercises: ZeRO-1 (P_os) on flat padded shards (paper Sec 5.1, Sec 7.2.1).

* ``02.shard_range`` (:mod:`.shard_range`): which elements of a flat buffer padded to a
  multiple of Nd a rank owns; checked on real ranks by gathering every rank's answer.
* ``02.zero1_step`` (:mod:`.zero1_step`): one ZeRO-1 step on a flat gradient:
  reduce-scatter, Adam on this rank's fp32 master shard, all-gather of the updated
  parameters; checked against single-process Adam, the ledger's 2 Psi per step and the
  optimizer state kept (K Psi / Nd).

Importing this package registers both.
"""

from zerolearn.exercises.ch02 import shard_range, zero1_step  # noqa: F401 - they register
