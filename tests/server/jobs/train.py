"""A rank of a small real DDP job streaming to a collector (DDPSCOPE_URL, DDPSCOPE_JOB from the env).

    python train.py STEPS [SLOW_RANK [forward|loader [SYNC,...]]]

Every rank sleeps BASE_SLEEP_S in its forward (data loading, say) so the step time is dominated by
something the oversubscribed CPU cannot distort; SLOW_RANK sleeps EXTRA_SLEEP_S more: a straggler about
50 % slower, in its forward (default) or, with ``loader``, before it (a slow data loader between steps).

SYNC adds what real loops do that makes the fast ranks wait for the slow one somewhere other than the
gradient all-reduce: ``loss`` all-reduces the loss after the optimizer step (for logging), ``subgroup``
does that on a group of ranks 0 and 1 only, ``buffers`` gives the model a BatchNorm whose buffers the
engine broadcasts from rank 0 before every forward. ``pairs`` wraps the model in DDP over a group of two
ranks, ranks 0 and 1 one replica group, ranks 2 and 3 another, each rank on batches of its own: the two
groups train two different models.

TRAIN_ENGINE=torch in the environment trains with torch's DDP observed by ``ddpscope.ddp.instrument()``
instead of ddpscope's engine.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from tests.support.job_model import finish, wrap

BASE_SLEEP_S = 0.02
EXTRA_SLEEP_S = 0.012  # about +50 % of a step on this machine


def main() -> None:
    steps = int(sys.argv[1])
    slow_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    slow_loader = len(sys.argv) > 3 and sys.argv[3] == "loader"
    syncs = set(sys.argv[4].split(",")) if len(sys.argv) > 4 else set()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = dist.new_group([0, 1]) if "subgroup" in syncs else None
    replica_group = None
    if "pairs" in syncs:  # every rank creates every group, in one order
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replica_group = pairs[rank // 2]
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(128)] if "buffers" in syncs else []
    net = nn.Sequential(
        nn.Linear(32, 128), *norm, nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )
    extra = EXTRA_SLEEP_S if rank == slow_rank else 0.0
    pause = BASE_SLEEP_S + (0.0 if slow_loader else extra)
    loader_pause = extra if slow_loader else 0.0
    net[0].register_forward_pre_hook(lambda *_: time.sleep(pause))
    model = wrap(
        net, os.environ.get("TRAIN_ENGINE", "ddpscope"), bucket_cap_mb=0.05, process_group=replica_group
    )
    if replica_group is not None:
        torch.manual_seed(1 + rank)  # batches of its own: the two replica groups' models grow apart
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        if loader_pause:
            time.sleep(loader_pause)  # the next batch, slow on this rank only
        out = model(torch.randn(16, 32))
        # The sum runs away to NaN in 16 steps; the pairs' models must stay finite to be told apart.
        loss = out.square().mean() if replica_group is not None else out.sum()
        loss.backward()
        opt.step()
        if "loss" in syncs:
            dist.all_reduce(loss.detach())
        if pair is not None and rank in (0, 1):
            dist.all_reduce(loss.detach(), group=pair)
    finish(steps - 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
