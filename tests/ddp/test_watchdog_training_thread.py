"""A training loop run on a thread of its own: the watchdog reads that thread, not the main one.

Some launchers and frameworks train on a worker thread while the main thread only joins it. The
watchdog's stall samples and hang reports must show where the *training* thread is (its line, its CPU),
or every report would say the rank is stuck in ``Thread.join``. Here the training thread is real: it runs
steps (which note it) and then blocks in user code; the test's thread moves the watchdog's clock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records, one_step, wait
from tests.support.procs import until_asleep


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def _train_then_block(progress: Progress, recorder: CollectiveRecorder, stepped: threading.Event,
                      release: threading.Event) -> None:  # fmt: skip
    for step in range(3):
        one_step(progress, recorder, step)
    stepped.set()
    release.wait(30)  # the line the reports must name: stuck in the training thread's own code


def _trainer(progress: Progress, recorder: CollectiveRecorder, stepped: threading.Event,
             release: threading.Event) -> threading.Thread:  # fmt: skip
    """The thread 'trainer' running ``_train_then_block``, started."""
    thread = threading.Thread(
        target=_train_then_block, args=(progress, recorder, stepped, release), name="trainer", daemon=True
    )
    thread.start()
    return thread


def test_a_loop_training_on_its_own_thread_is_sampled_and_reported_there_not_in_the_main_threads_join(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = wd.Watchdog(timeout_s=5.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock,
                      world_size=lambda: 2)  # fmt: skip
    stepped, release = threading.Event(), threading.Event()
    trainer = _trainer(progress, recorder, stepped, release)
    try:
        assert stepped.wait(10)
        until_asleep(trainer.native_id)  # in release.wait(), not on its way there under a loaded machine
        dog.check()
        wait(dog, clock, 6.0)
    finally:
        release.set()
        trainer.join(10)
    (sample, *_) = records("stall_sample")
    assert sample["thread"] == "trainer"
    assert sample["site"].startswith("tests/ddp/test_watchdog_training_thread.py:")
    assert "_train_then_block" in sample["stack"] and "release.wait(30)" in sample["stack"]
    assert sample["main_cpu_s"] is not None and sample["main_cpu_s"] < 1.0  # blocked: the trainer's CPU
    (hang,) = records("hang")
    assert hang["thread"] == "trainer"
    assert (
        "the training thread 'trainer' waits at tests/ddp/test_watchdog_training_thread.py:"
        in hang["message"]
    )
    assert "see the training thread 'trainer''s stack" in hang["message"]
    assert hang["blocked_call"] == {"syscall": "futex"}  # the trainer's thread, not the main one's join
    assert "it is blocked, waiting on a lock or condition variable (futex)" in hang["message"]
    assert {s["thread"] for s in hang["stacks"]} >= {"trainer", "MainThread"}


def test_once_the_training_thread_has_ended_the_main_thread_is_read_again(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = wd.Watchdog(timeout_s=30.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock,
                      world_size=lambda: 2)  # fmt: skip
    stepped, release = threading.Event(), threading.Event()
    release.set()  # the trainer runs its steps and ends
    _trainer(progress, recorder, stepped, release).join(10)
    dog.check()
    wait(dog, clock, 0.75)
    (sample,) = records("stall_sample")
    assert "thread" not in sample  # the main thread's: no name sent
    assert sample["site"].startswith("tests/ddp/watchdog_support.py:")  # this thread's wait()
