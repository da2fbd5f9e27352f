"""A job trained with ddpscope's engine whose rank 1 blocks outside any step, twice.

    python between_steps_job.py OUT_DIR

Every rank writes its records to OUT_DIR/rank<R>.jsonl. Lines marked ``# SITE:<name>`` are the lines
the tests expect in the hang reports (the test reads their line numbers from this file).

- Before the first step, rank 1 waits on an event for JOB_STALL_S (set-up: a checkpoint that takes
  long to load), while rank 0 waits for it in the first step's all-reduce.
- Between steps 1 and 2 both ranks evaluate for JOB_STALL_S: forwards without gradients and an
  all-reduce of the metric per batch. That is progress, not a hang.
- Between steps 3 and 4, rank 1 waits on an empty queue for JOB_STALL_S (a data loader whose workers
  deliver nothing), while rank 0 waits for it in step 4's all-reduce.
- In step 5, rank 1 waits JOB_STALL_S between its forward and its backward (a slow loss), while rank 0
  waits for it in step 5's all-reduce. Then both go on to the end.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import sys
import threading
import time

import _capture
import torch
import torch.distributed as dist

from ddpscope.ddp import DistributedDataParallel
from tests.support.job_end import destroy_together

STALL_S = float(os.environ.get("JOB_STALL_S", "3.5"))
STEPS = 7
EVAL_BATCH_S = 0.1


def evaluate(model: torch.nn.Module) -> None:
    """At least STALL_S of batches, as many on every rank: a loop that ends at each rank's own clock can run
    one all-reduce more on the rank that began it later, which then pairs with its peer's next bucket."""
    with torch.no_grad():
        for _ in range(int(STALL_S / EVAL_BATCH_S) + 1):
            metric = model(torch.randn(8, 32)).square().mean().reshape(1)
            dist.all_reduce(metric)  # SITE:evaluate
            time.sleep(EVAL_BATCH_S)


def main() -> None:
    out_dir = sys.argv[1]
    _capture.capture(out_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(  # starts the watchdog
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # imports for a second or more: set-up too
    batches: queue.Queue[torch.Tensor] = queue.Queue()
    if rank == 1:
        threading.Event().wait(STALL_S)  # SITE:before_first_step
    for step in range(STEPS):
        if step == 2:
            evaluate(model)
        if step == 4 and rank == 1:
            with contextlib.suppress(queue.Empty):
                batches.get(timeout=STALL_S)  # SITE:between_steps
        loss = model(torch.randn(8, 32)).square().mean()
        if step == 5 and rank == 1:
            threading.Event().wait(STALL_S)  # SITE:after_forward
        loss.backward()
        opt.step()
        opt.zero_grad()
    _capture.flush()
    destroy_together()


if __name__ == "__main__":
    main()
