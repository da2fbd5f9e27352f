"""A rank of a 2-rank job (DDPSCOPE_URL, DDPSCOPE_JOB from the env) whose rank 1 writes a log every sixth
step, to a file system that takes 2 s (a sleep): every other rank waits it out in the next all-reduce.

    python stall.py stall ddpscope|torch
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from tests.support.job_model import finish, wrap

STEPS = 40


def write_log(step: int) -> None:
    time.sleep(2.0)  # the slow write: the line the collector should name


def main() -> None:
    engine = sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = wrap(net, engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        if rank == 1 and step % 6 == 3:
            write_log(step)
        time.sleep(0.02)
    finish(STEPS - 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
