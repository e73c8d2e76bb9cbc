"""ZeRO-R (paper Sec 6): what remains once model states are partitioned.

``checkpointing`` (activation checkpoints: P_a, P_a+cpu, contiguous pools),
``tensor_parallel`` (a minimal Megatron-style model parallelism, Nm), ``buffers``
(CB: constant-size fused buffers), ``defrag`` (MD: an allocator simulator).
"""
