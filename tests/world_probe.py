"""A module run by tests/test_warm_process.py as the ranks of one world (warm_cli.run_world): each joins the process
group from torchrun's variables and all-reduces its rank. Argument ``fail``: rank 1 exits 3 before joining, so rank 0
would wait for it forever (the launcher must stop it)."""

import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if "fail" in sys.argv[1:] and rank == 1:
        sys.exit(3)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    print(f"rank={rank} world={dist.get_world_size()} local_rank={os.environ['LOCAL_RANK']} sum={x.item():g} "
          f"preloaded={'vllm' in sys.modules}")
    dist.destroy_process_group()
