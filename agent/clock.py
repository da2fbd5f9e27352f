"""The job's aligned clock: this host's wall clock, read through the monotonic clock, plus the offset to rank 0.

The engine estimates the offset at start-up (a ping-pong over the process group, on ``local_ns``) and sets
it here; every timestamp in a record is taken with ``now_ns()`` so ranks line up on one time axis.

Why not ``time.time_ns()`` itself: the wall clock is *stepped* when NTP or a VM's clock sync corrects it, and
a step back made a step record end before it began (seen once, 0.55 ms); a step mid-job also moves one
rank's times against the others' after the offset was measured. The monotonic clock is never stepped and is
slewed at the same rate as the wall clock, so anchored to it once per process it reads the wall clock less
the steps made since the process started: durations stay true and times still compare with other hosts'
(and the collector's) wall clocks to within those steps.
"""

from __future__ import annotations

import time


def _anchor_ns() -> int:
    """``time.time_ns() - time.monotonic_ns()``, from the closest pair of reads of a few (the two reads are
    not one instant; a preemption between them would put the whole process's clock off)."""
    best: tuple[int, int] | None = None
    for _ in range(5):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) // 2)
    assert best is not None
    return best[1]


_wall_minus_monotonic_ns = _anchor_ns()
_base_ns = _wall_minus_monotonic_ns
"""``_wall_minus_monotonic_ns`` plus the offset to rank 0: one addition per timestamp."""
_offset_ns = 0
_error_ns = 0


def now_ns() -> int:
    """The aligned clock: rank 0's time, in ns since the epoch."""
    return time.monotonic_ns() + _base_ns


def local_ns() -> int:
    """This host's clock as ``now_ns`` reads it, before the offset to rank 0: what the ping-pong compares."""
    return time.monotonic_ns() + _wall_minus_monotonic_ns


def set_offset(offset_ns: int, error_ns: int) -> None:
    global _base_ns, _offset_ns, _error_ns
    _offset_ns = int(offset_ns)
    _error_ns = int(error_ns)
    _base_ns = _wall_minus_monotonic_ns + _offset_ns


def offset_ns() -> int:
    return _offset_ns


def error_ns() -> int:
    return _error_ns
