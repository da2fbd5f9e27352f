"""A training process whose stderr is closed (a launcher that daemonizes its workers): logging's error
report then raises ``ValueError`` out of ``logger.warning`` itself. ddpscope's log calls must not."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator

import pytest

from ddpscope.agent.log import get_logger
from ddpscope.ddp import drift
from tests.ddp.watchdog_support import Records, in_memory_records


@contextlib.contextmanager
def closed_stderr() -> Iterator[None]:
    """stderr closed, and a handler writing to it on ddpscope's loggers (as logging's last resort does
    when no handler is configured; pytest's own handlers never fail). Entered inside the test: pytest
    puts its own stderr back between a fixture's set-up and the test."""
    closed = io.StringIO()
    closed.close()
    handler = logging.StreamHandler(closed)
    root = logging.getLogger("ddpscope")
    saved, raising = sys.stderr, logging.raiseExceptions
    sys.stderr, logging.raiseExceptions = closed, True
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        sys.stderr, logging.raiseExceptions = saved, raising


def test_logging_itself_raises_with_stderr_closed() -> None:
    # The premise: a plain logger call raises here.
    with closed_stderr(), pytest.raises(ValueError, match="closed file"):
        logging.getLogger("ddpscope.plain").warning("anything")


def test_a_ddpscope_log_call_with_stderr_closed_is_dropped_without_raising() -> None:
    log = get_logger("ddpscope.ddp.something")
    with closed_stderr():
        log.warning("a diagnostic %s", "line")
        try:
            raise KeyError("inside an except block, as the hooks log their failures")
        except KeyError:
            log.warning("failed", exc_info=True)


@pytest.fixture
def records() -> Iterator[Records]:
    yield from in_memory_records(1)


def test_the_unsynced_gradients_warning_record_goes_out_though_its_log_line_cannot(records: Records) -> None:
    with closed_stderr():
        drift.warn_unsynced(1, 3, "the backward() at train.py:9 ...", ["head.bias"], call_site="train.py:9")
    (warning,) = records("warning")
    assert (warning["code"], warning["call_site"], warning["step"]) == ("unsynced_gradients", "train.py:9", 3)
