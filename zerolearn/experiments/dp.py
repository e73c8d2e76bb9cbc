"""DP (stage 0): data parallelism, every rank holds all model states (Sec 2.1).

    torchrun --nproc-per-node 4 -m zerolearn.experiments.dp [--dtype bf16] [--steps 20] ...
"""

from zerolearn.experiments._run import main

if __name__ == "__main__":
    main(0, "DP (stage 0)")
