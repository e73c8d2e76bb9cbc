"""Runnable experiments, one script per chapter; the same code on GPUs (NCCL) and CPUs (gloo):

    torchrun --nproc-per-node 4 -m zerolearn.experiments.dp      # stage 0
    torchrun --nproc-per-node 4 -m zerolearn.experiments.zero1   # P_os
    torchrun --nproc-per-node 4 -m zerolearn.experiments.zero2   # P_os+g
    torchrun --nproc-per-node 4 -m zerolearn.experiments.zero3   # P_os+g+p

Each trains the book's GPT with its stage and prints what every rank holds and moves,
beside the paper's formula. Any option of ``python -m zerolearn.train`` works too.
"""
