"""allreduce.py: one all-reduce on every rank, started by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 allreduce.py

torchrun starts N copies of this script and tells each its place in environment
variables: RANK (0 to N - 1), WORLD_SIZE (N), and where rank 0 listens (MASTER_ADDR,
MASTER_PORT). Rank r holds the number r + 1; after one all-reduce every rank holds
the sum 1 + 2 + ... + N and prints ``rank R of N: the sum is S``.
"""

import os

import torch
import torch.distributed as dist


def main():
    """Join the process group, sum one number over the ranks, print it, leave the group."""
    # BEGIN SOLUTION
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # strings in the environment
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # connects to MASTER_ADDR:MASTER_PORT
    t = torch.tensor([float(rank + 1)])  # rank r holds r + 1
    dist.all_reduce(t)  # in place: the sum over the ranks, on every rank
    print(f"rank {rank} of {world_size}: the sum is {t.item():g}", flush=True)
    dist.destroy_process_group()  # leave the group before the process ends
    # END SOLUTION


if __name__ == "__main__":
    main()
