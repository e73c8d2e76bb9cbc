"""ZeRO-1 (P_os): optimizer states partitioned (Sec 5.1).

    torchrun --nproc-per-node 4 -m zerolearn.experiments.zero1 [--dtype bf16] [--steps 20] ...
"""

from zerolearn.experiments._run import main

if __name__ == "__main__":
    main(1, "ZeRO-1 (P_os)")
