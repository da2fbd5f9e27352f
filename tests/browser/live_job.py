"""Rank script of the live dashboard test: a small model under ddpscope's DDP engine on gloo.

``python live_job.py STOP_FILE PAUSE_S MAX_STEPS``; started once per rank by
``tests.support.procs.started_ranks`` with ``DDPSCOPE_URL`` pointing at the test's collector. The job
steps (pausing between steps) until the test creates STOP_FILE, so it is certainly still running while
the browser watches; rank 0 reads the file and all ranks agree through an all-reduce, so every rank
stops after the same step. Imports torch, so the test module never imports this.
"""

from __future__ import annotations

import os
import sys
import time


def main(stop_file: str, pause_s: float, max_steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.agent import get_agent
    from ddpscope.ddp import DistributedDataParallel
    from tests.support.job_end import destroy_together

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    # A small bucket cap gives several buckets, so the timeline has something to show per bucket.
    model = DistributedDataParallel(net, bucket_cap_mb=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    for _ in range(max_steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        stop = torch.tensor([1.0 if dist.get_rank() == 0 and os.path.exists(stop_file) else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
        time.sleep(pause_s)
    get_agent().force_flush(10.0)
    dist.barrier()
    destroy_together()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
