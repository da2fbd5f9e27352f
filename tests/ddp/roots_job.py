"""A raw torch.distributed job that misuses a root or a subgroup, streaming to a collector.

    python roots_job.py SCENARIO

Scenarios:
  bcast_src  2 ranks: a broadcast where each rank names itself as src (both wait until the timeout).
  subgroup   3 ranks, group [0, 1]: rank 0 all-reduces on the group, which rank 1 never does (it
             goes on to the default group's next all-reduce, where it waits for rank 0 with rank 2).
  monitored  3 ranks: ranks 0 and 1 enter a monitored_barrier (4 s timeout) that rank 2 skips (it goes
             on to the next all-reduce); rank 0's barrier raises, naming rank 2.
  slow_setup 3 ranks build ddpscope's engine; rank 1 first spends JOB_SETUP_S (default 6 s) loading
             (a checkpoint, say): rank 0 waits for it in the engine's start-up clock sync, and rank 2
             for rank 0. Then two steps, and a clean finish.

The process group's timeout is ``JOB_PG_TIMEOUT_S``: the hung collectives then raise and the ranks
exit with an error. Lines marked ``# SITE:<name>`` are the call sites the tests look for.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from ddpscope.agent import get_agent
from ddpscope.ddp import monitor
from tests.support.job_end import destroy_together


def main() -> None:
    scenario = sys.argv[1]
    timeout = datetime.timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT_S", "30")))
    dist.init_process_group("gloo", timeout=timeout)
    monitor.enable()
    rank = dist.get_rank()
    sub = dist.new_group([0, 1]) if scenario == "subgroup" else None
    for _ in range(3):
        dist.all_reduce(torch.ones(4))  # SITE:warmup
    if scenario == "bcast_src":
        dist.broadcast(torch.full((8,), float(rank)), src=rank)  # SITE:bcast
    elif scenario == "monitored":
        if rank != 2:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=4))  # SITE:monitored
        dist.all_reduce(torch.ones(4))  # SITE:after_barrier
    elif scenario == "subgroup":
        if rank == 0:
            dist.all_reduce(torch.ones(8), group=sub)  # SITE:sub
        dist.all_reduce(torch.ones(4))  # SITE:after
    elif scenario == "slow_setup":
        from ddpscope.ddp import DistributedDataParallel

        if rank == 1:
            time.sleep(float(os.environ.get("JOB_SETUP_S", "6")))
        model = DistributedDataParallel(torch.nn.Linear(4, 2))  # SITE:engine
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
    get_agent().force_flush(5.0)
    destroy_together()


if __name__ == "__main__":
    main()
