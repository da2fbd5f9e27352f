"""Rank script of the live dashboard test: a small model under ddpscope's DDP engine on gloo.

``python live_job.py STEPS PAUSE_S``; started once per rank by ``tests.support.procs.started_ranks``
with ``DDPSCOPE_URL`` pointing at the test's collector. The pause between steps keeps the job running
long enough for the browser to watch it grow. Imports torch, so the test module never imports this.
"""

from __future__ import annotations

import sys
import time


def main(steps: int, pause_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.agent import get_agent
    from ddpscope.ddp import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    # A small bucket cap gives several buckets, so the timeline has something to show per bucket.
    model = DistributedDataParallel(net, bucket_cap_mb=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        time.sleep(pause_s)
    get_agent().force_flush(10.0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
