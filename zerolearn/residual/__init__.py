"""ZeRO-R (paper Sec 6): what remains once model states are partitioned.

``checkpointing`` (activation checkpoints: P_a, P_a+cpu, contiguous pools),
``tensor_parallel`` (a minimal Megatron-style model parallelism, Nm), ``buffers``
(CB: constant-size fused buffers, the engines' ``bucket_mb``, measured), ``defrag``
(MD: real training steps recorded and replayed through ``allocator``, a model of the
caching allocator; CUDA allocator statistics) and ``setup`` (the train CLI's wiring).
"""
