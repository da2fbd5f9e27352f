"""A job whose ranks go wrong (or wait) between ``init_process_group`` and their DDP construction.

    python before_ddp_job.py SCENARIO OUT_DIR

The script does what a user's does: ``from ddpscope.ddp import instrument`` at the top, then
``init_process_group``, then set-up, then ``instrument(torch DDP(model))``; it never calls ddpscope's
monitor itself. The agent writes every record to OUT_DIR/rank<R>.jsonl (``_capture``, configured
before the group is created). Lines marked ``# SITE:<name>`` are the lines the tests expect.

Scenarios (rank 1 misbehaves; rank 0 goes on to build its model and fails or waits for rank 1):
  raise    rank 1 cannot open its data file (FileNotFoundError) after init_process_group.
  exit     rank 1 calls sys.exit(1) there.
  return   rank 1 returns from main with exit status 0 there (printing how long it took).
  wait     rank 1 sleeps JOB_STALL_S in its set-up (a slow checkpoint load); rank 0 waits in torch's
           DistributedDataParallel constructor meanwhile. Then both train a few steps.
  healthy  both ranks build their models at once and train a few steps.
  probe    (any world size) prints one JSON line saying what ddpscope installed once the group exists:
           used with DDPSCOPE_DISABLED=1, or with PROBE_CONFIGURE_DISABLED=1 (agent.configure(disabled=True)
           before init_process_group).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import _capture
import torch
import torch.distributed as dist

from ddpscope.ddp import instrument
from tests.support.job_end import destroy_together

STALL_S = float(os.environ.get("JOB_STALL_S", "6.0"))

ORIGINAL = {"exit": sys.exit, "all_reduce": dist.all_reduce}


def load_data(path: str) -> bytes:
    with open(path, "rb") as f:  # SITE:open
        return f.read()


def train(model: torch.nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return instrument(torch.nn.parallel.DistributedDataParallel(net))  # SITE:ddp


def probe(out_dir: str) -> None:
    if os.environ.get("PROBE_CONFIGURE_DISABLED"):
        from ddpscope import agent

        agent.configure(disabled=True)
    else:
        _capture.capture(out_dir, flusher=False)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    time.sleep(0.5)  # a watchdog started by the group's creation would be running by now
    facts = {
        "wrapped": hasattr(dist.init_process_group, "__ddpscope_init_hook__"),
        "threads": sorted(t.name for t in threading.enumerate()),
        # torch's init_process_group installs a hook of its own (the "[rank0]:" prefix): not ddpscope's.
        "excepthook_module": getattr(sys.excepthook, "__module__", None),
        "exit_kept": sys.exit is ORIGINAL["exit"],
        "all_reduce_kept": dist.all_reduce is ORIGINAL["all_reduce"],
    }
    print("PROBE " + json.dumps(facts), flush=True)
    dist.destroy_process_group()


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    if scenario == "probe":
        probe(out_dir)
        return
    _capture.capture(out_dir)
    started = time.monotonic()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == 1:
        if scenario == "raise":
            load_data(os.path.join(out_dir, "no-such-shard.bin"))
        elif scenario == "exit":
            sys.exit(1)  # SITE:exit
        elif scenario == "return":
            print(f"returning after {time.monotonic() - started:.2f} s", flush=True)
            return
        elif scenario == "wait":
            time.sleep(STALL_S)  # SITE:sleep
    print(f"building at {time.time_ns()}", flush=True)
    model = build()
    train(model)
    _capture.flush()
    destroy_together()


if __name__ == "__main__":
    main()
