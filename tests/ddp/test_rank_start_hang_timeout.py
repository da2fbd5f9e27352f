"""Both engines' ``rank_start`` carries the rank's hang timeout, the one its watchdog runs with, so the
collector can tell ranks that would report a stall at different times, and the process group's own timeout,
which ends a stall first when it is the shorter (a 1-rank gloo group in this process)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ddpscope.ddp import DistributedDataParallel, instrument, rank_start, watchdog
from tests.ddp.watchdog_support import Records, one_rank_job_records


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> Iterator[Records]:
    monkeypatch.setenv("DDPSCOPE_HANG_TIMEOUT", "42.5")  # read by the agent the fixture configures
    yield from one_rank_job_records()


def test_the_engine_s_rank_start_carries_the_hang_timeout_its_watchdog_runs_with(records: Records) -> None:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    (start,) = records("rank_start")
    running = watchdog.get_watchdog()
    assert running is not None and running.timeout_s == 42.5
    assert start["hang_timeout_s"] == 42.5
    model.remove_hooks()


def test_instrumented_torch_ddp_s_rank_start_carries_it_too(records: Records) -> None:
    model = instrument(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2)))
    (start,) = records("rank_start")
    assert start["hang_timeout_s"] == 42.5 and start["engine"] == "torch"
    model.__dict__["_ddpscope_instrumentation"].remove_hooks()


def test_an_explicit_hang_timeout_beats_the_configured_one_and_a_non_positive_one_is_refused(
    records: Records,
) -> None:
    assert watchdog.hang_timeout_setting() == 42.5
    assert watchdog.hang_timeout_setting(3.0) == 3.0
    with pytest.raises(ValueError, match="hang_timeout_s must be > 0"):
        watchdog.hang_timeout_setting(0.0)


def test_a_process_group_that_times_out_before_the_hang_watchdog_is_recorded_and_warned_about_once(
    records: Records, caplog: pytest.LogCaptureFixture
) -> None:
    rank_start._warn_group_times_out_first.cache_clear()  # once per process: earlier tests may have warned
    quick = dist.new_group([0], timeout=datetime.timedelta(seconds=5))
    first = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=quick)
    second = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=quick)
    starts = records("rank_start")
    assert [(s["group_timeout_s"], s["hang_timeout_s"]) for s in starts] == [(5.0, 42.5), (5.0, 42.5)]
    warned = [r.getMessage() for r in caplog.records if "process group's timeout" in r.getMessage()]
    assert warned == [
        "ddpscope: the process group's timeout (5 s) is shorter than the hang timeout (42.5 s): a stalled "
        "collective ends in torch's 'Timed out' error before ddpscope's hang report (every thread's stack, the "
        "rank holding the others up) is taken. Set DDPSCOPE_HANG_TIMEOUT below 5 s on every rank."
    ]
    first.remove_hooks()
    second.remove_hooks()


def test_the_default_group_s_timeout_longer_than_the_hang_timeout_is_recorded_without_a_warning(
    records: Records, caplog: pytest.LogCaptureFixture
) -> None:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    (start,) = records("rank_start")
    assert start["group_timeout_s"] >= 60.0  # torch's default: 30 minutes on gloo
    assert not [r for r in caplog.records if "process group's timeout" in r.getMessage()]
    model.remove_hooks()
