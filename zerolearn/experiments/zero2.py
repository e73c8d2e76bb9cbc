"""ZeRO-2 (P_os+g): gradients partitioned too (Sec 5.2).

    torchrun --nproc-per-node 4 -m zerolearn.experiments.zero2 [--dtype bf16] [--steps 20] ...
"""

from zerolearn.experiments._run import main

if __name__ == "__main__":
    main(2, "ZeRO-2 (P_os+g)")
