"""The aligned clock reads the wall clock through the monotonic clock, so a step of the wall clock (NTP, a VM's
clock sync) cannot put a record's times out of order."""

from __future__ import annotations

import time

import pytest

from ddpscope.agent import clock


@pytest.fixture(autouse=True)
def no_offset():
    yield
    clock.set_offset(0, 0)


def test_the_aligned_clock_reads_the_wall_clock_when_no_offset_is_set() -> None:
    wall = time.time_ns()
    assert abs(clock.now_ns() - wall) < 50_000_000  # the wall clock is not stepped while tests run


def test_the_offset_to_rank_0_is_added_to_the_ranks_own_clock() -> None:
    clock.set_offset(7_000_000_000, 12_000)
    own, aligned = clock.local_ns(), clock.now_ns()
    assert 7_000_000_000 <= aligned - own < 7_000_000_000 + 50_000_000
    assert (clock.offset_ns(), clock.error_ns()) == (7_000_000_000, 12_000)


def test_a_wall_clock_stepped_back_does_not_turn_the_aligned_clock_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = clock.now_ns()
    stepped = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: stepped() - 3_600_000_000_000)  # an hour back
    after = clock.now_ns()
    assert 0 <= after - before < 50_000_000
