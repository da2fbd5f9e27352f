"""A torchrun training script on ddpscope's engine: the only change is the DDP import.

    ddpscope serve &                                   # the collector, http://127.0.0.1:8321
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/train_ddpscope.py
    ddpscope report "$(ddpscope jobs --json | python -c 'import json,sys; print(json.load(sys.stdin)[0]["job"])')"

torchrun sets TORCHELASTIC_RUN_ID, which ddpscope uses as the job id (or set DDPSCOPE_JOB).
"""

import torch
import torch.distributed as dist
from torch import nn

from ddpscope.ddp import DistributedDataParallel  # was: from torch.nn.parallel import DistributedDataParallel


def main(steps: int = 50) -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    torch.manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
