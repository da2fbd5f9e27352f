"""A hang that ends in a failed collective is not progress: the watchdog never calls it resolved.

Sampled by hand on a manual clock, with the real recorder ending the collective as the engines do
(``RECORDER.end(..., ok=False)`` from the comm hook's callback, the patched ``Work.wait``, ``poll``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records


class PeerDeathWork:
    """An async collective's Work that completes, once ``done``, with the error gloo gives when a
    peer dies."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> PeerDeathWork:
        return self  # its value() raises, as a real Work's future does

    def value(self) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=0)


@pytest.fixture
def dog(progress: Progress, recorder: CollectiveRecorder, clock: ManualClock) -> wd.Watchdog:
    return wd.Watchdog(timeout_s=5.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock)


def hang_in_all_reduce(
    dog: wd.Watchdog, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> int:
    """Rank 0 launches a bucket all-reduce its peer never joins, and waits past the timeout."""
    progress.enter("backward", step=5)
    seq = recorder.begin("default", "all_reduce", [torch.ones(8)], reduce_op="SUM", source="engine", step=5)
    progress.enter("allreduce")
    dog.check()
    clock.now += 6.0
    dog.check()
    assert dog.hung
    return seq


def test_a_hang_ended_by_a_failed_collective_emits_no_hang_resolved(
    records: Records,
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
) -> None:
    seq = hang_in_all_reduce(dog, progress, recorder, clock)
    clock.now += 6.8
    recorder.end("default", seq, ok=False, error="Connection closed by peer [127.0.0.1]:29500")
    dog.check()
    assert len(records("hang")) == 1
    assert records("hang_resolved") == []
    assert not dog.hung  # the hang is over: it ended in the failure the rank_error reports
    (end,) = records("collective_end")
    assert end["ok"] is False


def test_the_failure_is_not_progress_even_when_the_phase_moves_in_the_same_tick(
    records: Records,
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
) -> None:
    # ddpscope's own engine ends the failed all-reduce, then its finalizer enters 'idle' as the
    # error leaves backward: both before the next sample.
    seq = hang_in_all_reduce(dog, progress, recorder, clock)
    recorder.end("default", seq, ok=False, error="Connection reset by peer")
    progress.enter("idle")
    clock.now += 0.25
    dog.check()
    assert records("hang_resolved") == []


def test_a_failed_async_collective_found_by_poll_does_not_resolve_the_hang(
    records: Records,
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
) -> None:
    progress.enter("idle")
    seq = recorder.begin("default", "barrier", [], call_site="train.py:9")
    work = PeerDeathWork()
    recorder.track("default", seq, work)
    dog.check()
    clock.now += 6.0
    dog.check()
    assert dog.hung
    work.done = True
    clock.now += 0.25
    dog.check()  # polls: the barrier completed with the peer's death
    assert records("hang_resolved") == [] and not dog.hung
    assert progress.inflight == {}


def test_progress_after_a_failure_ended_hang_reports_a_new_hang_normally(
    records: Records,
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
) -> None:
    seq = hang_in_all_reduce(dog, progress, recorder, clock)
    recorder.end("default", seq, ok=False, error="Connection closed by peer")
    dog.check()
    # The user caught the error and carried on; the next step is stuck again, then moves.
    progress.enter("forward", step=6)
    dog.check()
    clock.now += 6.0
    dog.check()
    assert len(records("hang")) == 2
    progress.enter("backward")
    dog.check()
    (resolved,) = records("hang_resolved")
    assert resolved["step"] == 6 and resolved["hang_s"] == pytest.approx(6.0)


def test_a_successful_end_after_a_hang_still_resolves_it(
    records: Records,
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
) -> None:
    seq = hang_in_all_reduce(dog, progress, recorder, clock)
    clock.now += 1.0
    recorder.end("default", seq, ok=True)
    dog.check()
    (resolved,) = records("hang_resolved")
    assert resolved["hang_s"] == pytest.approx(7.0)


def test_the_final_sample_at_stop_does_not_resolve_a_hang_that_ended_in_a_failure(
    records: Records,
    dog: wd.Watchdog,
    progress: Progress,
    recorder: CollectiveRecorder,
    clock: ManualClock,
) -> None:
    seq = hang_in_all_reduce(dog, progress, recorder, clock)
    dog.start()  # stop() takes one last sample; the thread may take it first: either way
    recorder.end("default", seq, ok=False, error="Connection closed by peer")
    dog.stop()
    assert not dog.running
    assert records("hang_resolved") == []
