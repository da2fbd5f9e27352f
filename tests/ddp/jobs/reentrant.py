"""One rank (a world of 1) trains ddpscope's engine through reentrant activation checkpointing.

    python reentrant.py unused|twice

``unused``: with find_unused_parameters=True (the checkpoint hides its parameters from the search);
``twice``: one block checkpointed twice. Prints the RuntimeError the engine raises, if any.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpscope.ddp import DistributedDataParallel


class Net(nn.Module):
    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.block, self.head, self.twice = nn.Linear(8, 8), nn.Linear(8, 2), twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=True)
        if self.twice:
            h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    model = DistributedDataParallel(Net(mode == "twice"), find_unused_parameters=mode == "unused")
    try:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        print("no error")
    except RuntimeError as e:
        print(e)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
