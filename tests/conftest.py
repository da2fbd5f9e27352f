"""Shared fixtures. Helpers that start processes live in tests/support/procs.py."""

from __future__ import annotations

import os

import pytest

from tests import streams

# One thread per rank and per test process: with more threads than cores, gloo steps get 3-4x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A rank's shipper process outlives it to deliver its spool (600 s in production when no collector
# answers). Tests start many ranks, some with no collector at all: keep the stragglers short-lived.
# Tests that need a longer outage set their own value.
os.environ.setdefault("DDPSCOPE_SHIPPER_LINGER_S", "20")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``DDPSCOPE_TEST_STREAM`` set (``tests/run_suite.py``), keep only that stream's tests."""
    stream = os.environ.get(streams.ENV)
    if not stream:
        return
    if stream not in streams.STREAMS:
        raise pytest.UsageError(f"{streams.ENV}={stream!r}: expected one of {', '.join(streams.STREAMS)}")
    keep, drop = [], []
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        marks = {m.name for m in item.iter_markers()}
        (keep if streams.stream_of(path, marks) == stream else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
