"""Fixtures the watchdog's hand-sampled tests share: a fresh progress counter, a recorder writing to
it, and a clock the test moves by hand."""

from __future__ import annotations

import pytest

from ddpscope.ddp.collectives import CollectiveRecorder
from ddpscope.ddp.progress import Progress
from tests.ddp.watchdog_support import ManualClock


@pytest.fixture
def progress() -> Progress:
    return Progress()


@pytest.fixture
def recorder(progress: Progress) -> CollectiveRecorder:
    return CollectiveRecorder(progress=progress)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
