"""A rank of a 2-rank job (DDPSCOPE_URL, DDPSCOPE_JOB from the env) that keeps 2 MiB every step on rank 1
(``leak``), with memory records every half second. ``workers``: rank 1 reads a batch a step from a
DataLoader worker whose Dataset keeps 2 MiB per item it serves (a cache never read). ``oom``: rank 1 first
moves itself into the memory cgroup ``LEAK_CGROUP`` names (its limit set by the test) and keeps 4 MiB a step until the
kernel's OOM killer ends it.

    python leak.py leak|workers|oom ddpscope|torch
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from tests.support.job_model import finish, wrap

STEPS = 240


class KeepingDataset(torch.utils.data.Dataset[torch.Tensor]):
    """Serves random batches and keeps 2 MiB for each one, in the worker process that serves it."""

    def __init__(self) -> None:
        self.cache: list[torch.Tensor] = []

    def __len__(self) -> int:
        return 10 * STEPS  # the worker lives to the rank's last step (an epoch's end would end it)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.cache.append(torch.ones(512, 1024))
        return torch.randn(8, 16)


def main() -> None:
    mode, engine = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "oom" and rank == 1:
        with open(os.path.join(os.environ["LEAK_CGROUP"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))  # from here on its new memory counts against the cgroup's limit
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = wrap(net, engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    batches = (
        iter(torch.utils.data.DataLoader(KeepingDataset(), batch_size=None, num_workers=1))
        if mode == "workers" and rank == 1
        else None
    )
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(next(batches) if batches is not None else torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        if mode == "leak" and rank == 1:
            kept.append(torch.ones(512, 1024))  # 2 MiB a step, kept "for logging"
        elif mode == "oom" and rank == 1:
            kept.append(torch.ones(1024, 1024))  # 4 MiB a step, until the OOM killer
        time.sleep(0.03)
    finish(STEPS - 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["DDPSCOPE_MEMORY_INTERVAL_S"] = "0.5"  # read when the watchdog starts, with the process group
    main()
