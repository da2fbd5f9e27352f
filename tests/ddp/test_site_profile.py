"""Where the training thread spends its time, sampled at each watchdog tick (``ddp/site_profile.py``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ddpscope.ddp import watchdog as wd
from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from ddpscope.ddp.site_profile import MAX_SITES, SiteProfile, waits_for_loader
from ddpscope.ddp.stacks import format_stack
from tests.ddp.watchdog_support import ManualClock, Records, in_memory_records, one_step, wait


def test_the_first_record_comes_five_seconds_after_sampling_began_and_then_at_doubling_intervals() -> None:
    profile = SiteProfile()
    taken = []
    for tick in range(1, 4 * 4 * 60):  # four minutes of 0.25 s ticks
        now = 100 + tick * 0.25
        profile.add(now, "idle", "train.py:12")
        if (record := profile.take(now, step=tick)) is not None:
            taken.append((now - 100, record["samples"]))
    assert [t for t, _ in taken] == [5.25, 15.5, 35.75, 76.0, 136.25, 196.5]
    assert [n for _, n in taken] == [21, 41, 81, 161, 241, 241]


def test_a_record_names_the_most_sampled_phases_and_lines_and_counts_the_rest() -> None:
    profile = SiteProfile()
    now = 0.0
    for i in range(40):
        now += 0.25
        profile.add(now, "idle", "train.py:12" if i % 2 else f"lib.py:{i}")
    record = profile.take(now, step=7)
    assert record is not None and record["kind"] == "site_profile" and record["step"] == 7
    assert record["samples"] == 40 and record["sites"][0] == {"phase": "idle", "site": "train.py:12", "n": 20}
    assert len(record["sites"]) == MAX_SITES and record["other"] == 40 - 20 - (MAX_SITES - 1)


def test_the_samples_left_when_the_watchdog_stops_make_a_last_record_if_there_are_enough() -> None:
    profile = SiteProfile()
    for tick in range(10):
        profile.add(tick * 0.25, "forward", "model.py:3")
    assert profile.take(2.5, step=4) is None  # not due yet
    record = profile.take(2.5, step=4, final=True)
    assert record is not None and record["samples"] == 10 and record["interval_s"] == 2.5
    assert profile.take(2.5, step=4, final=True) is None  # nothing left


def test_too_few_samples_in_an_interval_make_no_record() -> None:
    profile = SiteProfile()
    profile.add(0.0, "idle", "train.py:12")
    profile.add(6.0, "idle", "train.py:12")  # a rank that was hung meanwhile: not sampled
    assert profile.take(6.0, step=1) is None


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(rank=1)


def test_the_watchdog_samples_the_phase_and_users_line_after_the_first_step_and_not_while_hung(
    records: Records, progress: Progress, recorder: CollectiveRecorder, clock: ManualClock
) -> None:
    dog = wd.Watchdog(timeout_s=30.0, heartbeat_s=1.0, progress=progress, recorder=recorder, clock=clock,
                      main_cpu_s=lambda: 0.0, world_size=lambda: 2)  # fmt: skip
    wait(dog, clock, 10.0)  # set-up: no step yet, nothing sampled
    one_step(progress, recorder, 0)
    dog.check()
    wait(dog, clock, 5.5)  # between steps, in this test's wait()
    (record,) = records("site_profile")
    # 5 s of ticks from the first after the step (which is sampled too): 21 samples.
    assert record["step"] == 0 and record["samples"] == 21, record
    top = record["sites"][0]
    assert (top["phase"], top["n"]) == ("idle", 20) and top["site"].startswith(
        "tests/ddp/watchdog_support.py:"
    )
    assert {x["phase"] for x in record["sites"]} == {"idle"}  # the other one: this test's dog.check()
    wait(dog, clock, 60.0)  # hung 30 s after the step: from then on its time is the hang report's
    assert records("hang") and [r["samples"] for r in records("site_profile")[1:]] == [41]


class SlowDataset(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(3.0)  # a slow read, in the worker process
        return torch.zeros(2)


def test_a_thread_waiting_for_its_dataloaders_workers_is_told_from_one_in_its_own_code() -> None:
    loader = torch.utils.data.DataLoader(SlowDataset(), num_workers=1)
    started = threading.Event()

    def train() -> None:
        started.set()
        for _ in loader:  # waits ~3 s for the worker's first batch
            break

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    started.wait(5)
    time.sleep(1.0)  # the worker started and reads
    waiting = sys._current_frames()[thread.ident or -1]
    assert waits_for_loader(waiting), format_stack(waiting)
    assert not waits_for_loader(sys._current_frames()[threading.get_ident()])  # this test's own line
    thread.join(10)
