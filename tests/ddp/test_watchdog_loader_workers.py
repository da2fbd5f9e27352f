"""A rank stuck waiting for its DataLoader's workers: its hang report says what each worker process is blocked
in (``Watchdog._loader_workers``), read from the worker's own ``/proc``: a real DataLoader whose worker reads a
named pipe no one writes (a network mount that stopped answering)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddpscope.agent.blocked_call import read_process
from ddpscope.agent.memory import worker_pids
from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records, one_step, wait

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


class StuckShard(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        fd = os.open(self.fifo, os.O_RDWR)  # O_RDWR: the open does not wait for a writer; the read does
        os.read(fd, 1)
        return torch.zeros(2)


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def test_a_hang_waiting_for_the_dataloader_says_what_its_worker_is_blocked_in(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock, tmp_path: Path
) -> None:
    fifo = tmp_path / "shard-17.bin"
    os.mkfifo(fifo)
    loader = torch.utils.data.DataLoader(StuckShard(fifo), num_workers=1)
    started = threading.Event()

    def train() -> None:
        started.set()
        for _ in loader:  # the worker never delivers until the test writes to the pipe
            break

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    started.wait(5)
    frames = sys._current_frames
    dog = wd.Watchdog(timeout_s=30.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock,
                      main_cpu_s=lambda: 0.0, world_size=lambda: 2,
                      main_frame=lambda: frames().get(thread.ident or -1))  # fmt: skip
    try:
        deadline = time.monotonic() + 30  # the worker starts and reaches its read
        while time.monotonic() < deadline and not any(
            (read_process(pid) or {}).get("syscall") == "read" for pid in worker_pids()
        ):
            time.sleep(0.05)
        one_step(progress, recorder, 0)
        dog.check()
        wait(dog, clock, 31.0)
        (hang,) = records("hang")
        (worker,) = hang["loader_workers"]
        on = worker["blocked_call"]["on"]
        assert worker["blocked_call"] == {
            "syscall": "read",
            "on": [{**on[0], "kind": "fifo", "name": str(fifo)}],
        }
        assert worker["pid"] != os.getpid()
        # The rank's own message (its log) says it too.
        assert (
            f"it waits for its DataLoader's workers: worker {worker['pid']} waiting on the named pipe {fifo} (read)"
            in hang["message"]
        ), hang["message"]
    finally:
        with open(fifo, "wb", buffering=0) as f:
            f.write(b"xxxx")  # lets the worker go
        thread.join(20)
