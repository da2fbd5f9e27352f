"""A raw torch.distributed job whose ranks all-reduce tensors of different sizes: gloo aborts one rank.

    python mismatch_job.py user|engine   (RANK, WORLD_SIZE, MASTER_* and DDPSCOPE_* from the environment)

``user``: three matching all-reduces, then one of 8 elements on rank 0 and 16 on the others, from
the line tagged ``mismatch``. ``engine``: a model wrapped in ddpscope's engine; at step 2 rank 1
issues a stray all-reduce (line tagged ``stray``), larger than the bucket, where rank 0's backward
launches its bucket all-reduce: gloo aborts the smaller receiver, the engine's side.

The agent is configured from the environment only (spool + shipper to ``DDPSCOPE_URL``), as in a
real job: nothing here flushes, so whatever reaches the collector from the aborted rank got there
by the agent's own durability.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from ddpscope.ddp import monitor


def user(rank: int) -> None:
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
    dist.all_reduce(torch.ones(8 if rank == 0 else 16))  # SITE:mismatch


def engine(rank: int) -> None:
    from ddpscope.ddp import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)))
    for step in range(4):
        loss = model(torch.randn(8, 32)).square().mean()
        if rank == 1 and step == 2:
            dist.all_reduce(torch.ones(10_000))  # SITE:stray
        loss.backward()


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    monitor.enable()
    {"user": user, "engine": engine}[sys.argv[1]](dist.get_rank())
    # Only reached if gloo did not abort this rank: give the peer's abort time to reset the connection.
    time.sleep(float(os.environ.get("JOB_STALL_S", "5")))


if __name__ == "__main__":
    main()
