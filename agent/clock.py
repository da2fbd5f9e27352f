"""The job's aligned clock: this host's ``time.time_ns()`` plus the offset to rank 0.

The engine estimates the offset at start-up (a ping-pong over the process group) and sets it here;
every timestamp in a record is taken with ``now_ns()`` so ranks line up on one time axis.
"""

from __future__ import annotations

import time

_offset_ns = 0
_error_ns = 0


def now_ns() -> int:
    return time.time_ns() + _offset_ns


def set_offset(offset_ns: int, error_ns: int) -> None:
    global _offset_ns, _error_ns
    _offset_ns = int(offset_ns)
    _error_ns = int(error_ns)


def offset_ns() -> int:
    return _offset_ns


def error_ns() -> int:
    return _error_ns
