"""A job launched by torch.multiprocessing.spawn: no RANK in the environment, the rank is an argument.

Each rank prints the rank its agent labels records with, and the one its watchdog names in reports."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

import ddpscope.ddp  # noqa: F401  (imported first, as the README asks)
from ddpscope import agent
from ddpscope.ddp import watchdog


def worker(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    labelled = agent.get_agent().config.rank
    print(f"rank {rank}: agent {labelled}, watchdog {watchdog._rank()}", flush=True)
    agent.configure(job=os.environ["DDPSCOPE_JOB"])  # a script that configures the agent itself, after
    print(f"rank {rank}: reconfigured {agent.get_agent().config.rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    mp.spawn(worker, args=(2,), nprocs=2)
