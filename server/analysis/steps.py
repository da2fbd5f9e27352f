"""Per-step, per-rank timing: the definitions every view shares (API, /metrics, dashboard).

- ``step_s`` = backward end - forward start; ``forward_s``, ``backward_s`` the phases' spans.
- ``comm_s``: total all-reduce time, the length of the union of the buckets' [launch, end] spans
  (all-reduces overlap each other, so a plain sum would count time twice).
- ``exposed_comm_s``: the part of that union after the last gradient was ready (nothing left to
  hide it behind). ``overlap_ratio`` = (comm - exposed) / comm, None when the step had no all-reduce.
- ``compute_s``: forward start to the last bucket ready (the straggler definition's compute time);
  ``wait_s``: last bucket ready to backward end, i.e. waiting for all-reduces (and so for peers).

``step_metrics`` computes them for one row and is the reference; ``page_metrics`` computes them for a
page of rows at once with numpy (the steps view), and gives exactly the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import le
from typing import NamedTuple

import numpy as np

from ddpscope.server.rows import StepRow, StepTimes
from ddpscope.server.step_page import PAD, Ints, StepPage

NS = 1e9
_BEFORE_ANY_TIME = -(1 << 66)
"""Earlier than any stored time plus its shift (both int64)."""


@dataclass(slots=True)
class StepMetrics:
    rank: int
    step: int
    synced: bool
    step_s: float
    forward_s: float
    backward_s: float
    comm_s: float
    exposed_comm_s: float
    overlap_ratio: float | None
    compute_s: float
    wait_s: float


def union_after(starts: Sequence[int], ends: Sequence[int], after: int) -> tuple[int, int]:
    """(length of the union of [start, end] spans, length of that union after ``after``), in ns.
    Span i is ``[starts[i], ends[i]]``.

    Written with plain comparisons (no ``max`` calls): it runs once per rank per step in every view.
    """
    total = exposed = 0
    # The current segment starts empty and before any time (an empty segment adds nothing), so no
    # time is a sentinel: a clock may read negative.
    cur_s = cur_e = _BEFORE_ANY_TIME
    # Launched in bucket order, the spans usually come sorted already: skip building and sorting pairs.
    in_order = all(map(le, starts[:-1], starts[1:]))
    pairs = zip(starts, ends, strict=False) if in_order else sorted(zip(starts, ends, strict=False))
    for s, e in pairs:
        if e < s:
            continue  # a span still in flight or garbled: it has no length to count
        if s > cur_e:
            total += cur_e - cur_s
            if cur_e > after:
                exposed += cur_e - (cur_s if cur_s > after else after)
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    total += cur_e - cur_s
    if cur_e > after:
        exposed += cur_e - (cur_s if cur_s > after else after)
    return total, exposed


class StepTiming(NamedTuple):
    """One row of a page as straggler scoring reads it: the scalar times and the last ready time."""

    rank: int
    step: int
    forward_start_ns: int
    forward_end_ns: int
    backward_start_ns: int
    backward_end_ns: int
    blocked_between_ns: int
    blocked_forward_ns: int
    blocked_backward_ns: int
    last_ready_ns: int


def last_ready_ns(row: StepRow | StepTimes | StepTiming) -> int:
    """When the step's last bucket became ready (backward end when it had no bucket)."""
    if isinstance(row, StepTiming):
        return row.last_ready_ns  # computed for the whole page by ``page_last_ready``
    t = row if isinstance(row, StepTimes) else StepTimes.of(row)  # one formula for both shapes
    return max(t.ready) if len(t.ready) else t.backward_end_ns


def step_metrics(row: StepRow | StepTimes) -> StepMetrics:
    t = row if isinstance(row, StepTimes) else StepTimes.of(row)
    last_ready = last_ready_ns(t)
    comm, exposed = union_after(t.starts, t.ends, last_ready)
    overlap = (comm - exposed) / comm if comm > 0 else None
    return StepMetrics(
        rank=row.rank,
        step=row.step,
        synced=row.synced,
        step_s=(row.backward_end_ns - row.forward_start_ns) / NS,
        forward_s=(row.forward_end_ns - row.forward_start_ns) / NS,
        backward_s=(row.backward_end_ns - row.backward_start_ns) / NS,
        comm_s=comm / NS,
        exposed_comm_s=exposed / NS,
        overlap_ratio=overlap,
        compute_s=(last_ready - row.forward_start_ns) / NS,
        wait_s=max(0, row.backward_end_ns - last_ready) / NS,
    )


def mean_overlap(metrics: Sequence[StepMetrics]) -> float | None:
    """Overlap over several steps, weighted by comm time (a short step does not count as much)."""
    comm = sum(m.comm_s for m in metrics if m.overlap_ratio is not None)
    if comm <= 0:
        return None
    return sum(m.comm_s - m.exposed_comm_s for m in metrics if m.overlap_ratio is not None) / comm


_EXACT_RANGE = 2**52
"""Within this range of nanoseconds every difference and union length of a row is exact as a float64,
so the page's arithmetic gives the same values as ``step_metrics``' Python integers."""
_SAFE_MAGNITUDE = 2**62
"""Times no larger than this can be subtracted from each other in int64 without overflow."""


def page_metrics(page: StepPage) -> list[StepMetrics]:
    """``step_metrics`` of every row of ``page``, computed column-wise (see ``union_after`` for the union)."""
    if not len(page):
        return []
    if not _within_exact_range(page):  # a row's times weeks apart (garbled input): row by row
        return [step_metrics(row) for row in page.rows()]
    last_ready = page_last_ready(page)
    comm = _union_lengths(page.starts, page.ends)
    exposed = _union_lengths(
        np.maximum(page.starts, last_ready[:, None]), np.maximum(page.ends, last_ready[:, None])
    )
    fs, be = page.forward_start_ns, page.backward_end_ns
    overlap = [(c - e) / c if c > 0 else None for c, e in zip(comm.tolist(), exposed.tolist(), strict=True)]
    return list(
        map(
            StepMetrics,
            page.rank.tolist(),
            page.step.tolist(),
            page.synced.tolist(),
            ((be - fs) / NS).tolist(),
            ((page.forward_end_ns - fs) / NS).tolist(),
            ((be - page.backward_start_ns) / NS).tolist(),
            (comm / NS).tolist(),
            (exposed / NS).tolist(),
            overlap,
            ((last_ready - fs) / NS).tolist(),
            (np.maximum(be - last_ready, 0) / NS).tolist(),
        )
    )


def page_last_ready(page: StepPage) -> Ints:
    """``last_ready_ns`` of every row of ``page``."""
    last: Ints = np.where(page.ready_count > 0, page.ready.max(axis=1, initial=PAD), page.backward_end_ns)
    return last


def page_timings(page: StepPage) -> list[StepTiming]:
    """The page's rows as ``StepTiming``: what straggler scoring reads, without a Python int per bucket."""
    columns = (
        page.rank, page.step, page.forward_start_ns, page.forward_end_ns, page.backward_start_ns,
        page.backward_end_ns, page.blocked_between_ns, page.blocked_forward_ns, page.blocked_backward_ns,
        page_last_ready(page),
    )  # fmt: skip
    return list(map(StepTiming._make, zip(*(c.tolist() for c in columns), strict=True)))


def _union_lengths(starts: Ints, ends: Ints) -> Ints:
    """Per row, the length of the union of its [start, end] spans.

    Sorted by start, span i adds what lies beyond every earlier end: ``max(0, reach_i - max(start_i,
    reach_before_i))`` with ``reach`` the running maximum of the ends. A span with end < start is still
    in flight: it becomes [start, start], which adds nothing, as ``union_after`` skips it. Padding
    spans are [PAD, PAD] (or clipped to [after, after]): they add nothing either."""
    ends = np.maximum(ends, starts)
    order = np.argsort(starts, axis=1, kind="stable")
    starts = np.take_along_axis(starts, order, axis=1)
    reach = np.maximum.accumulate(np.take_along_axis(ends, order, axis=1), axis=1)
    before = np.empty_like(reach)
    before[:, :1] = PAD
    before[:, 1:] = reach[:, :-1]
    gained: Ints = np.maximum(reach - np.maximum(starts, before), 0)
    return gained.sum(axis=1)


def _within_exact_range(page: StepPage) -> bool:
    """Whether each row's times lie within ``_EXACT_RANGE`` of each other (and none is ``PAD``)."""
    big = np.iinfo(np.int64).max
    lo = np.minimum.reduce(
        [page.forward_start_ns, page.forward_end_ns, page.backward_start_ns, page.backward_end_ns]
    )
    hi = np.maximum.reduce(
        [page.forward_start_ns, page.forward_end_ns, page.backward_start_ns, page.backward_end_ns]
    )
    for m, count in (
        (page.ready, page.ready_count),
        (page.starts, page.span_count),
        (page.ends, page.span_count),
    ):
        padding = m == PAD
        if m.size - int(padding.sum()) != int(
            count.sum()
        ):  # a time equal to the padding: not a clock reading
            return False
        lo = np.minimum(lo, np.where(padding, big, m).min(axis=1, initial=big))
        hi = np.maximum(hi, m.max(axis=1, initial=PAD))
    if int(lo.min()) <= -_SAFE_MAGNITUDE or int(hi.max()) >= _SAFE_MAGNITUDE:
        return False
    return bool(((hi - lo) < _EXACT_RANGE).all())
