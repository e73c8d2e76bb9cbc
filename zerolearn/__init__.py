"""zerolearn: the Zero Redundancy Optimizer (Rajbhandari et al., SC'20), built to be read.

Engines for data parallelism (stage 0) and ZeRO stages 1-3 on real torch.distributed
process groups, with ledgers that measure the memory and traffic the paper predicts.
"""

__version__ = "0.1.0"
