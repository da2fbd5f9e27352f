"""Both engines' ``rank_start`` carries the rank's hang timeout, the one its watchdog runs with, so the
collector can tell ranks that would report a stall at different times (a 1-rank gloo group in this
process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddpscope.ddp import DistributedDataParallel, instrument, watchdog
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
