"""The same job on stock torch DDP, observed with ``instrument()``: torch's Reducer keeps the gradients.

OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/train_instrument.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpscope.ddp import instrument


def main(steps: int = 50) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = instrument(DistributedDataParallel(model))  # the one added line
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
