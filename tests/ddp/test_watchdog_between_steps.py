"""A rank stuck between steps or before its first step: no collective in flight, phase 'idle'.

Sampled by hand on a manual clock, and once as a real thread while the main thread blocks in a queue.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records, one_step, wait


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def make(
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
    main_cpu_s: Callable[[], float | None] = lambda: 0.0,
) -> wd.Watchdog:
    return wd.Watchdog(
        timeout_s=5.0,
        heartbeat_s=1.0,
        progress=progress,
        recorder=recorder,
        clock=clock,
        main_cpu_s=main_cpu_s,
    )


def test_a_rank_stuck_between_steps_gets_one_hang_report_saying_where_its_main_thread_waits(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    for step in range(8):
        one_step(progress, recorder, step)
        dog.check()
    wait(dog, clock, 4.75)
    assert records("hang") == []
    wait(dog, clock, 10.0)  # well past the timeout: still exactly one report
    (hang,) = records("hang")
    # The shape the collector reads as "stuck in its own code": idle, nothing in flight or pending.
    assert (hang["phase"], hang["step"]) == ("idle", 7)
    assert hang["inflight"] == [] and hang["pending_buckets"] == [] and hang["stalled_s"] >= 5.0
    main = next(s for s in hang["stacks"] if s["thread"] == "MainThread")
    assert "test_watchdog_between_steps.py" in main["stack"]
    message = hang["message"]
    assert message.startswith(
        "rank 1 has made no progress for 5.0 s between steps, after step 7 "
        "(the optimizer step, data loading or its own code)"
    )
    assert "its last collective was default#8 all_reduce" in message
    assert "the main thread waits at tests/ddp/watchdog_support.py:" in message
    assert "No collective is in flight: this rank itself is stuck" in message
    assert dog.hung and dog.hangs_reported == 1


def test_the_next_forward_resolves_a_hang_between_steps(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    one_step(progress, recorder, 0)
    dog.check()
    wait(dog, clock, 7.5)
    assert len(records("hang")) == 1
    progress.enter("forward", 1)
    dog.check()
    (resolved,) = records("hang_resolved")
    assert resolved["hang_s"] == pytest.approx(7.5) and resolved["step"] == 1
    assert not dog.hung


def test_a_long_evaluation_between_steps_that_issues_collectives_is_never_reported(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    one_step(progress, recorder, 0)
    dog.check()
    for _ in range(60):  # 60 s of evaluation, 12 timeouts long, one metric all-reduce per 1 s batch
        wait(dog, clock, 1.0)
        recorder.end("default", recorder.begin("default", "all_reduce", [torch.ones(1)]))
        dog.check()
    assert records("hang") == [] and not dog.hung
    wait(dog, clock, 5.0)  # the evaluation stopped issuing anything: now it is stuck
    (hang,) = records("hang")
    assert hang["step"] == 0 and "between steps, after step 0" in hang["message"]


def test_before_the_first_step_an_idle_rank_is_not_reported_but_a_collective_in_flight_is(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    # The engine's construction broadcast its state; then set-up goes on (imports, a checkpoint).
    recorder.end("default", recorder.begin("default", "broadcast", [torch.ones(8)], source="engine"))
    dog = make(progress, recorder, clock)
    dog.check()
    wait(dog, clock, 60.0)
    assert records("hang") == [] and not dog.hung
    seq = recorder.begin("default", "barrier", [], call_site="train.py:12")  # waits for a late peer
    dog.check()
    wait(dog, clock, 5.0)
    (hang,) = records("hang")
    assert (hang["phase"], hang["step"]) == ("idle", 0)
    assert hang["message"].startswith(
        "rank 1 has made no progress for 5.0 s before its first step; "
        "collective default#2 barrier at train.py:12 is in flight"
    )
    recorder.end("default", seq)
    dog.check()
    assert len(records("hang_resolved")) == 1
    # From the first step on, idle is watched too.
    one_step(progress, recorder, 0)
    dog.check()
    wait(dog, clock, 5.0)
    assert "between steps, after step 0" in records("hang")[-1]["message"]


@pytest.mark.parametrize(
    ("cpu_per_s", "words"),
    [
        (0.001, "the main thread used 0.0 s of CPU meanwhile: it is blocked, waiting"),
        (0.98, "the main thread used 4.9 s of CPU meanwhile: it is busy, not waiting"),
    ],
)
def test_a_between_steps_report_tells_a_blocked_main_thread_from_a_busy_one(
    records: Records,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
    cpu_per_s: float,
    words: str,
) -> None:
    start = clock.now
    dog = make(progress, recorder, clock, main_cpu_s=lambda: 50.0 + cpu_per_s * (clock.now - start))
    one_step(progress, recorder, 3)
    dog.check()
    wait(dog, clock, 5.0)
    (hang,) = records("hang")
    assert words in hang["message"]
    if cpu_per_s > 0.5:
        assert "raise DDPSCOPE_HANG_TIMEOUT" in hang["message"]


def test_a_rank_waiting_in_a_collective_between_steps_is_not_told_about_cpu(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    one_step(progress, recorder, 2)
    recorder.begin("default", "barrier", [], call_site="train.py:40")
    dog.check()
    wait(dog, clock, 5.0)
    (hang,) = records("hang")
    assert (
        "between steps, after step 2; collective default#2 barrier at train.py:40 is in flight"
        in (hang["message"])
    )
    assert "CPU" not in hang["message"] and "its own code" not in hang["message"]


def test_the_thread_reports_a_main_thread_blocked_in_a_queue_at_the_users_line_not_inside_the_queue(
    records: Records,
) -> None:
    progress = Progress()
    dog = wd.Watchdog(
        timeout_s=0.3, heartbeat_s=0.1, progress=progress, recorder=CollectiveRecorder(progress=progress)
    )
    progress.enter("forward", 4)
    progress.enter("idle")
    batches: queue.Queue[int] = queue.Queue()

    def deliver_once_reported() -> None:
        deadline = time.monotonic() + 20
        while not dog.hung and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        batches.put(1)

    dog.start()
    helper = threading.Thread(target=deliver_once_reported, daemon=True)
    helper.start()
    try:
        line = sys._getframe().f_lineno + 1
        batch = batches.get(timeout=20)  # a data loader whose workers deliver nothing, for a while
        progress.enter("forward", 5)
        deadline = time.monotonic() + 20
        while dog.hung and time.monotonic() < deadline:
            threading.Event().wait(0.02)
    finally:
        dog.stop()
        helper.join(5)
    assert batch == 1
    (hang,) = records("hang")
    main = next(s for s in hang["stacks"] if s["thread"] == "MainThread")
    assert "queue.py" in main["stack"] and "batches.get(timeout=20)" in main["stack"]
    assert f"the main thread waits at tests/ddp/test_watchdog_between_steps.py:{line};" in hang["message"]
    assert "it is blocked, waiting" in hang["message"]
    assert len(records("hang_resolved")) == 1 and dog.errors == 0
