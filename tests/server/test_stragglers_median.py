"""The straggler analysis' 'median of the other ranks', computed from one sort per step."""

from __future__ import annotations

import statistics

from hypothesis import given
from hypothesis import strategies as st

from ddpscope.server.analysis.stragglers import median_without

values = st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.5]) | st.floats(0, 10), min_size=2, max_size=12)


@given(values, st.data())
def test_the_median_without_one_rank_equals_the_median_of_the_others(
    vs: list[float], data: st.DataObject
) -> None:
    j = data.draw(st.integers(0, len(vs) - 1))
    others = vs[:j] + vs[j + 1 :]
    assert median_without(sorted(vs), vs[j]) == statistics.median(others)
