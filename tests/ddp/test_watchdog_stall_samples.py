"""A rank's own stalls, sampled: where its main thread is when it holds the others up now and then.

The watchdog sends the main thread's stack 0.5 s into a stall of the rank's own (no progress, nothing
of it in flight, after its first step) and at each doubling, at most one stall in 5 s; shorter stalls once
they recur. Sampled by hand
on a manual clock; the main thread is this test's, so the site is its clock helper (``wait``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records, one_step, wait


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def make(progress: Progress, recorder: CollectiveRecorder, clock: ManualClock) -> wd.Watchdog:
    return wd.Watchdog(
        timeout_s=30.0,
        heartbeat_s=1.0,
        progress=progress,
        recorder=recorder,
        clock=clock,
        main_cpu_s=lambda: 0.0,
        world_size=lambda: 2,  # in a process group
    )


def test_a_stall_between_steps_is_sampled_half_a_second_in_and_at_each_doubling_with_the_users_line(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    for step in range(3):
        one_step(progress, recorder, step)
        dog.check()
    wait(dog, clock, 0.25)
    assert records("stall_sample") == []
    wait(dog, clock, 4.0)
    samples = records("stall_sample")
    assert [s["stalled_s"] for s in samples] == [0.5, 1.0, 2.0, 4.0]
    first = samples[0]
    assert (first["step"], first["phase"], first["main_cpu_s"]) == (2, "idle", 0.0)
    assert first["site"].startswith("tests/ddp/watchdog_support.py:")  # the innermost user frame: wait()
    assert "in wait" in first["stack"] and "dog.check()" in first["stack"]
    assert records("hang") == []  # a stall, not a hang: the timeout is 30 s


def test_a_rank_waiting_in_a_collective_before_its_first_step_or_outside_a_process_group_sends_no_sample(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    wait(dog, clock, 2.0)  # set-up: no step yet
    one_step(progress, recorder, 0)
    dog.check()
    progress.enter("forward", 1)
    progress.enter("backward")
    recorder.begin("default", "all_reduce", [torch.ones(8)], source="engine")  # waits for a stalled peer
    progress.enter("allreduce")
    wait(dog, clock, 3.0)
    outside = wd.Watchdog(timeout_s=30.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock,
                          world_size=lambda: None)  # fmt: skip
    progress.inflight.clear()
    progress.enter("idle")
    outside.check()
    wait(outside, clock, 2.0)  # after destroy_process_group, or in a rendezvous making the group again
    assert records("stall_sample") == []


def test_a_second_stall_within_five_seconds_of_the_last_sampled_one_is_not_sampled(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    one_step(progress, recorder, 0)
    dog.check()
    wait(dog, clock, 0.75)  # a stall, sampled 0.5 s in
    one_step(progress, recorder, 1)
    dog.check()
    wait(dog, clock, 4.5)  # another, due 0.75 s after that sample: not sampled, however long it lasts
    one_step(progress, recorder, 2)
    dog.check()
    wait(dog, clock, 2.25)  # due 5.25 s after the first sample: sampled at 0.5, 1 and 2 s
    assert [(s["step"], s["stalled_s"]) for s in records("stall_sample")] == [
        (0, 0.5),
        (2, 0.5),
        (2, 1.0),
        (2, 2.0),
    ]


def test_a_rank_whose_every_step_goes_quiet_for_a_second_is_sampled_only_when_a_step_takes_twice_that(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    for step in range(12):  # a second without progress in every step (a long forward): its usual
        one_step(progress, recorder, step)
        dog.check()
        wait(dog, clock, 1.0)
    # Sampled before it knew the rank's usual (0.5 s, then 1 s in), then no more.
    assert [(s["step"], s["stalled_s"]) for s in records("stall_sample")] == [(0, 0.5), (0, 1.0)]
    one_step(progress, recorder, 12)
    dog.check()
    wait(dog, clock, 3.0)  # three times its usual: sampled at twice it (the next is due at 4 s)
    assert [(s["step"], s["stalled_s"]) for s in records("stall_sample")[2:]] == [(12, 2.0)]


def ticks_with_a_stall_every(
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
    every: int,
    ticks: int,
) -> None:
    """``ticks`` watchdog ticks of a rank that finishes a step between any two of them, but after every
    ``every``-th tick makes no progress for one tick: the shortest stall the watchdog can see. As in a real
    job, a tick while the rank computes comes a little late (the watchdog waits for the GIL), one while it
    sleeps on time."""
    step = 0
    for tick in range(ticks):
        if tick % every == every - 1:
            wait(dog, clock, 0.25)
            continue
        one_step(progress, recorder, step)
        step += 1
        clock.now += 0.26
        dog.check()


def test_short_stalls_that_recur_are_sampled_once_they_make_a_pattern_though_none_reaches_half_a_second(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    # A write of a quarter second or so every eighth tick: each stall too short for the 0.5 s threshold,
    # but every peer waits it out.
    dog = make(progress, recorder, clock)
    ticks_with_a_stall_every(dog, progress, recorder, clock, every=8, ticks=32)
    # The stalls at ticks 7, 15 and 23 made the pattern; the one at tick 31 is sampled as the tick sees it.
    assert [(s["step"], s["phase"], s["stalled_s"]) for s in records("stall_sample")] == [(27, "idle", 0.25)]


def test_short_stalls_far_apart_are_not_sampled(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = make(progress, recorder, clock)
    # A one-tick stall every 120 ticks: never three within 100 steps.
    ticks_with_a_stall_every(dog, progress, recorder, clock, every=120, ticks=480)
    assert records("stall_sample") == []
