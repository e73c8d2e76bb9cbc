"""One script per chapter, the same code on GPUs (NCCL) and CPUs (gloo):

    torchrun --nproc-per-node 4 -m zerolearn.chapters.dp      # stage 0
    torchrun --nproc-per-node 4 -m zerolearn.chapters.zero1   # P_os
    torchrun --nproc-per-node 4 -m zerolearn.chapters.zero2   # P_os+g
    torchrun --nproc-per-node 4 -m zerolearn.chapters.zero3   # P_os+g+p

Each trains the book's GPT with its stage and prints what every rank holds and moves,
beside the paper's formula. Any option of ``python -m zerolearn.train`` works too.
"""
