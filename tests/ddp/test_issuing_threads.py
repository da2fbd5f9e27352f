"""Collectives of one group issued from two threads at once: said once per group, before they mispair."""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ddpscope.agent.records import COLLECTIVES_FROM_THREADS
from ddpscope.ddp.issuing_threads import IssuingThreads
from tests.ddp.watchdog_support import Records, in_memory_records


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=0)


def warnings(records: Records) -> list[dict[str, Any]]:
    return [r for r in records("warning") if r["code"] == COLLECTIVES_FROM_THREADS]


def in_thread(
    work: Callable[[], None], name: str = "metrics-logger"
) -> tuple[threading.Thread, threading.Event]:
    """Run ``work`` on a started thread that then stays alive until the returned event is set."""
    done, release = threading.Event(), threading.Event()

    def run() -> None:
        work()
        done.set()
        release.wait(10)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    assert done.wait(10)
    return thread, release


def test_a_thread_issuing_on_the_group_the_main_thread_keeps_using_is_said_once_with_both_names(
    records: Records,
) -> None:
    threads = IssuingThreads(site=lambda: "train.py:40")
    threads.note("default", 3)  # the main thread: the engine's all-reduce
    thread, release = in_thread(lambda: threads.note("default", 3))
    threads.note("default", 3)  # the main thread again while the logger still runs: a race
    threads.note("default", 4)
    thread2, release2 = in_thread(lambda: threads.note("default", 4), name="second")
    threads.note("default", 4)
    release.set()
    release2.set()
    (said,) = warnings(records)
    assert said["pg"] == "default" and said["step"] == 3
    assert "the main thread (this call at train.py:40) and thread 'metrics-logger'" in said["message"]
    assert "Issue every collective of a group from one thread" in said["message"]


def test_each_group_is_judged_on_its_own(records: Records) -> None:
    threads = IssuingThreads()
    threads.note("default", 0)
    thread, release = in_thread(lambda: threads.note("pg:1", 0))  # the logger has a group of its own
    threads.note("default", 0)
    release.set()
    assert warnings(records) == []


def test_a_hand_off_to_a_training_thread_and_back_once_it_ended_is_no_race(records: Records) -> None:
    threads = IssuingThreads()
    threads.note("default", 0)  # set-up on the main thread
    thread = threading.Thread(target=lambda: [threads.note("default", s) for s in range(3)], name="trainer")
    thread.start()
    thread.join()
    threads.note("default", 3)  # a final barrier once training is over
    assert warnings(records) == []


def test_threads_torch_starts_in_cpp_count_as_the_main_thread(records: Records) -> None:
    # autograd's threads run the engine's all-reduces for a main thread blocked in backward(): threading
    # sees them as dummy threads, which _thread.start_new_thread makes too.
    threads = IssuingThreads()
    threads.note("default", 0)
    ran = threading.Event()

    def autograd_like() -> None:
        threads.note("default", 0)
        ran.set()

    _thread.start_new_thread(autograd_like, ())
    assert ran.wait(10)
    threads.note("default", 0)
    _thread.start_new_thread(autograd_like, ())
    assert warnings(records) == []
