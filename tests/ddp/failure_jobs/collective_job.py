"""A raw torch.distributed job (no DDP engine) that misbehaves on purpose, per scenario.

    python collective_job.py SCENARIO OUT_DIR

Every rank installs the collective recorder, the error hooks and the watchdog, and writes its
records to OUT_DIR/rank<R>.jsonl. Lines marked ``# SITE:<name>`` are the call sites the tests expect
in the records (the test reads their line numbers from this file).

Scenarios:
  stall    a few collectives of several kinds; at step 1 rank 1 sleeps before its all-reduce, so
           rank 0 waits inside gloo (hang, then hang_resolved).
  extra    rank 1 issues one all-reduce more than rank 0, then waits in it until rank 0 exits.
  order    same-shape all-reduces in a different order on the two ranks (silently wrong on gloo).
  raise    rank 1 raises an uncaught exception at step 2.
  healthy  torch DDP training of a small MLP plus a user all-reduce of the loss each step, and an
           asynchronous one whose Work nobody waits for.
  mismatch an all-reduce of different sizes on the two ranks: gloo aborts a process.
  engine   the same with ddpscope's engine (small buckets); rank 1 sleeps before the forward of
           step 2, so rank 0 waits in its bucket all-reduces.
  groups   20 short-lived groups, each made, used for one all-reduce and destroyed (a group per
           evaluation, say); prints the process's open descriptors and threads before and after.
  regroup  a group only rank 0 is in, then every group destroyed and made again (torch reuses the
           names): the new groups' collectives are numbered from 1 on both ranks.
  group_order  rank 0 creates a group of both ranks, then one of rank 0 alone; rank 1 the other way
           round. torch names groups by the order of these calls, so each rank waits to connect a group
           its peer never creates, until the groups' short timeout.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import _capture
import torch
import torch.distributed as dist

from ddpscope.ddp import collectives, monitor
from ddpscope.ddp.progress import PROGRESS
from tests.support.job_end import destroy_together

STALL_S = float(os.environ.get("JOB_STALL_S", "3.0"))


def reduce_a(t: torch.Tensor) -> None:
    dist.all_reduce(t)  # SITE:reduce_a


def reduce_b(t: torch.Tensor) -> None:
    dist.all_reduce(t)  # SITE:reduce_b


def stall(rank: int) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dist.broadcast(t, src=0)  # SITE:broadcast
    out = [torch.zeros(5, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.full((5,), rank, dtype=torch.int64))  # SITE:all_gather
    dist.barrier()  # SITE:barrier
    if rank == 0:
        dist.send(torch.ones(6), dst=1, tag=3)  # SITE:send
    elif rank == 1:
        dist.recv(torch.zeros(6), src=0, tag=3)  # SITE:recv
    for step in range(3):
        PROGRESS.enter("allreduce", step)
        if rank == 1 and step == 1:
            time.sleep(STALL_S)  # SITE:sleep
        dist.all_reduce(torch.ones(16), op=dist.ReduceOp.MAX)  # SITE:step_all_reduce
        PROGRESS.enter("idle")


def extra(rank: int) -> None:
    for _ in range(2):
        dist.all_reduce(torch.ones(8))  # SITE:common
    if rank == 1:
        dist.all_reduce(torch.ones(8))  # SITE:extra
    else:
        time.sleep(STALL_S)
        _capture.flush()
        os._exit(0)  # rank 0 leaves without a goodbye: rank 1's extra all-reduce then fails


def order(rank: int) -> None:
    a, b = torch.ones(4), torch.full((4,), 2.0)
    if rank == 0:
        reduce_a(a)
        reduce_b(b)
    else:
        reduce_b(b)
        reduce_a(a)
    dist.barrier()


def raise_error(rank: int) -> None:
    for step in range(4):
        PROGRESS.enter("forward", step)
        if rank == 1 and step == 2:
            raise ValueError(f"bad batch on rank {rank} at step {step}")  # SITE:raise
        dist.all_reduce(torch.ones(4))
        PROGRESS.enter("idle")


def healthy(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        PROGRESS.enter("forward", step)
        loss = model(torch.randn(8, 32)).square().mean()
        PROGRESS.enter("backward")
        loss.backward()
        PROGRESS.enter("optimizer")
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach())  # SITE:loss
        dist.all_reduce(loss.detach().clone(), async_op=True)  # SITE:fire  (its Work never waited for)
        PROGRESS.enter("idle")
    print(f"internal_errors={collectives.RECORDER.internal_errors}")


def engine(rank: int) -> None:
    from ddpscope.ddp import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
        bucket_cap_mb=0.005,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        if rank == 1 and step == 2:
            time.sleep(STALL_S)  # a straggler far slower than the hang timeout
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach())  # SITE:engine_loss
    print(f"internal_errors={collectives.RECORDER.internal_errors}")


def mismatch(rank: int) -> None:
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
    # Different sizes at the same sequence number: gloo aborts the receiving process (SIGABRT).
    dist.all_reduce(torch.ones(8 if rank == 0 else 16))  # SITE:mismatch
    time.sleep(STALL_S)


def groups(rank: int) -> None:
    def resources() -> str:
        return f"fds={len(os.listdir('/proc/self/fd'))} threads={len(os.listdir('/proc/self/task'))}"

    before = resources()
    for _ in range(20):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(4), group=group)  # SITE:group_all_reduce
        dist.destroy_process_group(group)
        del group
    print(f"before {before}\nafter {resources()}")


def regroup(rank: int) -> None:
    solo = dist.new_group([0])
    if rank == 0:
        for _ in range(3):
            dist.all_reduce(torch.ones(4), group=solo)  # SITE:solo_all_reduce
    dist.all_reduce(torch.ones(4))  # SITE:first_world_all_reduce
    store = dist.distributed_c10d._get_default_store()  # kept alive: the next generation meets on it
    dist.destroy_process_group()
    generation = dist.PrefixStore("generation-2", store)
    dist.init_process_group("gloo", store=generation, rank=rank, world_size=2)
    pair = dist.new_group([0, 1])  # the name the solo group had
    dist.all_reduce(torch.ones(4), group=pair)  # SITE:pair_all_reduce
    dist.all_reduce(torch.ones(4))  # SITE:second_world_all_reduce


def group_order(rank: int) -> None:
    timeout = datetime.timedelta(seconds=STALL_S)
    dist.all_reduce(torch.ones(4))  # SITE:before_groups
    try:
        if rank == 0:
            dist.new_group([0, 1], timeout=timeout)  # SITE:group_pair
            dist.new_group([0], timeout=timeout)
        else:
            dist.new_group([0], timeout=timeout)  # SITE:group_solo
            dist.new_group([0, 1], timeout=timeout)
    except Exception as exc:  # torch's timeout: the job goes on to exit, as a loop that logs it would
        print(f"new_group failed: {type(exc).__name__}", flush=True)


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    _capture.capture(out_dir)
    monitor.enable()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    scenarios = {"stall": stall, "extra": extra, "order": order, "raise": raise_error, "healthy": healthy}
    scenarios.update(
        engine=engine, mismatch=mismatch, groups=groups, regroup=regroup, group_order=group_order
    )
    scenarios[scenario](rank)
    _capture.flush()
    destroy_together()


if __name__ == "__main__":
    main()
