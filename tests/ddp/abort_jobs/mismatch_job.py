"""A raw torch.distributed job whose ranks all-reduce tensors of different sizes: gloo aborts one rank.

    python mismatch_job.py          (RANK, WORLD_SIZE, MASTER_* and DDPSCOPE_* from the environment)

Three matching all-reduces, then one of 8 elements on rank 0 and 16 on the others, from the line
marked with the ``mismatch`` site tag. The agent is configured from the environment only (spool + shipper to
``DDPSCOPE_URL``), as in a real job: nothing here flushes, so whatever reaches the collector from
the aborted rank got there by the agent's own durability.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from ddpscope.ddp import monitor


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    monitor.enable()
    rank = dist.get_rank()
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
    dist.all_reduce(torch.ones(8 if rank == 0 else 16))  # SITE:mismatch
    # Only reached if gloo did not abort this rank: give the peer's abort time to reset the connection.
    time.sleep(float(os.environ.get("JOB_STALL_S", "5")))


if __name__ == "__main__":
    main()
