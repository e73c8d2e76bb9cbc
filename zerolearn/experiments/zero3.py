"""ZeRO-3 (P_os+g+p): parameters partitioned too (Sec 5.3).

    torchrun --nproc-per-node 4 -m zerolearn.experiments.zero3 [--dtype bf16] [--steps 20] ...
"""

from zerolearn.experiments._run import main

if __name__ == "__main__":
    main(3, "ZeRO-3 (P_os+g+p)")
