"""Chapter 2, ZeRO-1 (P_os): partition the optimizer states (paper Sec 5.1, Sec 7.2.1).

The chapter's exercises, each the reader's function (``<name>.py``) beside its check
(``<name>_check.py``):

* ``02.shard_range``: which elements of a flat buffer padded to a multiple of Nd a
  rank owns; checked on real ranks by gathering every rank's answer;
* ``02.zero1_step``: one ZeRO-1 step on a flat gradient: reduce-scatter, Adam on this
  rank's fp32 master shard, all-gather of the updated parameters; checked against
  single-process Adam, the ledger's 2 Psi per step and the optimizer state kept
  (K Psi / Nd).
"""
