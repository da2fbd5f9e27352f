"""One rank of a job that hangs: a small model trained with ddpscope's engine on gloo, then the last
rank stops issuing work (as a deadlocked data loader would) while the others wait in all-reduce.

Run once per rank by tests/deploy/test_prometheus_e2e.py (RANK, WORLD_SIZE, MASTER_* and DDPSCOPE_*
set by the test). The test kills every rank by pid when it is done.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

from ddpscope.ddp import DistributedDataParallel
from ddpscope.ddp.watchdog import start_watchdog


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--healthy-steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    # The engine starts the watchdog too; starting it here (idempotent) keeps this job valid on its own.
    start_watchdog()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    for step in range(args.healthy_steps + 1000):
        if step == args.healthy_steps and rank == world - 1:
            time.sleep(3600)  # alive and heartbeating, but never enters the next all-reduce
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    main()
