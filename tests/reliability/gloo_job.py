"""A short real DDP job: gloo on the CPU, ddpscope's own engine, the agent configured from the env.

``python gloo_job.py STEPS [PAUSE_S]``: every rank trains a small MLP for STEPS steps with
``ddpscope.ddp.DistributedDataParallel`` (one step record per backward through ``agent.emit``),
printing ``STEP n T`` after each step (the record is emitted by then; T is ``time.monotonic()``,
one clock for every process on the host), sleeping PAUSE_S between steps,
then exits normally.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ddpscope.ddp import DistributedDataParallel
from tests.support.job_end import destroy_together


def main(steps: int, pause_s: float) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    for step in range(steps):
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        print(f"STEP {step} {time.monotonic():.6f}", flush=True)
        if pause_s:
            time.sleep(pause_s)
    dist.barrier()
    destroy_together()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
