"""A rank blocked in its own code: the hang report and stall sample say which system call its training
thread sits in and on what, here a real ``store.wait()`` on the default group's TCPStore for a key no rank
sets (the store's address named as such), read by the real watchdog."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, one_rank_job_records, one_step, wait
from tests.support.procs import until_asleep


@pytest.fixture
def records() -> Iterator[Records]:
    yield from one_rank_job_records()


def _wait_for_a_key_no_rank_sets(
    progress: Progress, recorder: CollectiveRecorder, stepped: threading.Event
) -> None:
    for step in range(2):
        one_step(progress, recorder, step)
    stepped.set()
    store = dist.distributed_c10d._get_default_store()
    with contextlib.suppress(Exception):  # the store's timeout ends the thread
        store.wait(["ckpt-done"], datetime.timedelta(seconds=4))  # the key is spelled "ckpt_done" elsewhere


def test_a_rank_waiting_on_the_process_groups_store_is_said_to_wait_there_with_the_stores_address(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = wd.Watchdog(timeout_s=5.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock,
                      world_size=lambda: 2)  # fmt: skip
    stepped = threading.Event()
    trainer = threading.Thread(
        target=_wait_for_a_key_no_rank_sets, args=(progress, recorder, stepped), name="trainer", daemon=True
    )
    trainer.start()
    try:
        assert stepped.wait(10)
        threading.Event().wait(0.3)  # into the store's wait (this thread's sleep frees the GIL for it)
        until_asleep(trainer.native_id)  # and asleep there, not waiting for a core
        dog.check()
        wait(dog, clock, 6.0)
    finally:
        trainer.join(10)
    host, port = wd._store_address() or ("?", 0)
    (sample, *_) = records("stall_sample")
    (hang,) = records("hang")
    for record in (sample, hang):
        (on,) = record["blocked_call"]["on"]
        assert on["kind"] == "tcp" and on["role"] == "store" and on["name"].endswith(f":{port}"), record
    assert f"it is blocked, waiting on the process group's store at {on['name']}" in hang["message"]
    assert "store.wait() or store.get() of a key no rank has set yet" in hang["message"]
