"""One rank of a demo job: a small MLP trained with ddpscope's engine on gloo, with one fault injected.

Run by ``ddpscope demo`` as ``python -m ddpscope.cli.scenario_job --scenario NAME --steps N`` in each
rank's own process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and DDPSCOPE_* set by the launcher).
The faults are real ones, not simulated records: a slow rank, a parameter that gets no gradient, two
collectives issued in a different order, a rank killed by SIGKILL, a rank that stops issuing work, a batch
with a NaN in it.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

from ddpscope.ddp import DistributedDataParallel

FAULT_STEP = 6
"""The step at which the injected fault starts: late enough that the job has a healthy baseline."""


class DemoNet(nn.Module):
    def __init__(self, slow_s: float = 0.0) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, 10)
        self.aux_head = nn.Linear(512, 10)
        self.slow_s = slow_s
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        if self.slow_s:
            # A rank that computes slower (thermal throttling, a noisy neighbour): extra forward time.
            time.sleep(self.slow_s)
        out = self.head(h)
        return out + self.aux_head(h) if self.use_aux else out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    scenario = args.scenario

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    unlucky = world - 1  # the rank that gets the fault
    model = DemoNet()
    ddp = DistributedDataParallel(model, find_unused_parameters=(scenario == "unused_found"))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    forward_s: list[float] = []
    for step in range(args.steps):
        if step == FAULT_STEP and rank == unlucky:
            if scenario == "straggler":
                # Compute is forward + backward, and backward costs about twice forward on this MLP:
                # 1.5 forward times of extra work make this rank's compute about 50 % longer.
                model.slow_s = 1.5 * sorted(forward_s)[len(forward_s) // 2]
            elif scenario == "unused":
                # This rank stops using a branch; the engine names the parameters (no silent wrong grads).
                model.use_aux = False
            elif scenario == "diverged":
                # Nothing fails: DDP broadcast the state at construction only, so the ranks now train
                # different models (the checkpoint is made up here: the current state, nudged).
                model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
            elif scenario == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario == "hang":
                # Stuck before forward (a deadlocked data loader): alive, heartbeating, issuing nothing.
                time.sleep(3600)
        if step == FAULT_STEP and scenario == "mismatch":
            # Same shapes, different order on one rank: gloo returns silently wrong sums.
            a, b = torch.ones(4), torch.ones(4)
            if rank == unlucky:
                dist.all_reduce(b, op=dist.ReduceOp.MAX)
                dist.all_reduce(a, op=dist.ReduceOp.SUM)
            else:
                dist.all_reduce(a, op=dist.ReduceOp.SUM)
                dist.all_reduce(b, op=dist.ReduceOp.MAX)
        batch = x
        if step == FAULT_STEP and rank == unlucky and scenario == "nan":
            # One corrupt sample on one rank: its loss is NaN, and the all-reduce carries it to every rank.
            batch = x.clone()
            batch[0, 0] = float("nan")
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        out = ddp(batch)
        forward_s.append(time.perf_counter() - started - model.slow_s)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
