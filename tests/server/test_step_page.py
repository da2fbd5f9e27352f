"""A page of step rows decoded as columns gives exactly the per-row reference's metrics."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.agent import records as wire
from ddpscope.server.analysis.steps import last_ready_ns, page_metrics, page_timings, step_metrics
from ddpscope.server.rows import StepRow
from ddpscope.server.step_page import SCALARS, StepPage

DAY_NS = 86_400 * 10**9


def _db_row(
    rank: int, step: int, times: tuple[int, int, int, int], arrays: list[list[int]], blocked: int = 0
) -> tuple:
    """What the database hands back for a page: the scalar columns, then the packed blob."""
    extra = [[1] * len(arrays[0]), list(range(len(arrays[0]))), []]  # bytes, ready order, collective seqs
    blocked_times = (blocked, 2 * blocked, 3 * blocked)  # between steps, in forward, in backward
    return (rank, step, True, *times, *blocked_times, wire.pack_step_arrays(arrays + extra))


def _times(row: tuple) -> StepRow:
    """The row fully unpacked, by the agent's own reader (``records.unpack_step_arrays``)."""
    named = SimpleNamespace(**dict(zip((*SCALARS, "arrays"), row, strict=True)), time_ns=0, stream="s", seq=0)
    return StepRow.from_db(named)


def _reference(row: tuple) -> object:
    return step_metrics(_times(row))


# A value of an array: near the row's base (1-, 2- or 4-byte widths, and wrapping past a 2**32
# boundary), all equal (width 0), or far away (width 8).
offsets = st.one_of(st.integers(0, 200), st.integers(0, 70_000), st.integers(-(2**33), 2**33))


@st.composite
def rows(draw: st.DrawFn, rank: int) -> tuple:
    base = draw(st.sampled_from([1_700_000_000 * 10**9, (1 << 32) * 400_000_000 - 3_000, 0, 12345]))
    buckets = draw(st.integers(0, 12))
    constant = draw(st.booleans())

    def array(n: int) -> list[int]:
        return [base] * n if constant else [base + draw(offsets) for _ in range(n)]

    ready = array(buckets)
    starts = array(buckets + draw(st.integers(-2, 2)) if buckets > 1 else buckets)  # unpaired tails
    # Ends mostly after their starts; some before (still in flight), some overlapping others.
    ends = [s + draw(st.integers(-1_000, 5_000_000)) for s in starts[: buckets + draw(st.integers(-1, 1))]]
    fs = base + draw(st.integers(-(10**9), 0))
    times = (fs, fs + draw(st.integers(0, 10**6)), fs + draw(st.integers(0, 10**7)), base + draw(offsets))
    return _db_row(
        rank, draw(st.integers(0, 10**6)), times, [ready, starts, ends], draw(st.integers(0, 10**6))
    )


pages = st.integers(1, 8).flatmap(lambda n: st.tuples(*[rows(r) for r in range(n)]))


@settings(max_examples=300, deadline=None)
@given(page=pages)
def test_a_pages_metrics_and_timings_equal_the_row_by_row_reference_exactly(page: tuple) -> None:
    columns = StepPage.from_db(list(page))
    assert page_metrics(columns) == [_reference(r) for r in page]
    timings = page_timings(columns)
    assert [t.last_ready_ns for t in timings] == [last_ready_ns(_times(r)) for r in page]
    for timing, row in zip(timings, page, strict=True):  # every other field as stored
        assert timing == (*row[:2], *row[3:10], timing.last_ready_ns)


def test_a_page_whose_rows_are_months_apart_still_gives_the_reference_values() -> None:
    # Too far apart for float64 to hold every difference exactly: computed row by row instead.
    now = 1_700_000_000 * 10**9
    page = [
        _db_row(0, 1, (now, now + 5, now + 6, now + 90), [[now + 40], [now + 41], [now + 80]]),
        _db_row(1, 1, (0, 5, 6, 100 * DAY_NS), [[100 * DAY_NS - 9], [3], [100 * DAY_NS - 1]]),
    ]
    assert page_metrics(StepPage.from_db(page)) == [_reference(r) for r in page]


def test_an_empty_page_has_no_metrics_and_head_keeps_the_first_rows() -> None:
    assert page_metrics(StepPage.from_db([])) == []
    page = [_db_row(r, 7, (0, 1, 2, 30), [[10, 20], [10, 20], [15, 28]]) for r in range(3)]
    first = StepPage.from_db(page).head(2)
    assert page_metrics(first) == [_reference(r) for r in page[:2]]
