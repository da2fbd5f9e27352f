"""The collector's numpy check of a block's packed arrays answers exactly as the agent's reference."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.agent import records as wire
from ddpscope.server.packed import NUMPY_FROM, all_well_formed, numpy_all_well_formed

values = st.lists(st.one_of(st.integers(0, 300), st.integers(-(2**40), 2**40), st.just(2**62)), max_size=6)
step_arrays = st.tuples(*[values] * len(wire.STEP_ARRAYS)).map(lambda a: wire.pack_step_arrays(list(a)))
HEADER = struct.Struct("<B" + "IBq" * len(wire.STEP_ARRAYS))


@st.composite
def damaged(draw: st.DrawFn, blob: bytes) -> bytes:
    """A blob with one header field or its length changed (or left as it was)."""
    head = list(HEADER.unpack_from(blob))
    what = draw(st.sampled_from(["none", "version", "count", "width", "base", "truncate", "extend"]))
    field = 1 + 3 * draw(st.integers(0, len(wire.STEP_ARRAYS) - 1))
    if what == "version":
        head[0] = draw(st.integers(0, 255))
    elif what == "count":
        head[field] = draw(st.integers(0, 2**32 - 1))
    elif what == "width":
        head[field + 1] = draw(st.integers(0, 9))
    elif what == "base":
        head[field + 2] = draw(st.sampled_from([2**63 - 1, wire._SAFE_BASE, wire._SAFE_BASE + 1, -(2**63)]))
    blob = HEADER.pack(*head) + blob[HEADER.size :]
    if what == "truncate":
        return blob[: draw(st.integers(0, len(blob)))]
    if what == "extend":
        return blob + b"\0" * draw(st.integers(1, 9))
    return blob


blocks = st.lists(step_arrays.flatmap(damaged), min_size=0, max_size=12)


@settings(max_examples=500, deadline=None)
@given(blobs=blocks, size_error=st.integers(-3, 3))
def test_the_numpy_check_of_a_block_answers_as_the_reference(blobs: list[bytes], size_error: int) -> None:
    sizes = [len(b) for b in blobs]
    joined = b"".join(blobs)
    assert numpy_all_well_formed(joined, sizes) == wire.packed_all_well_formed(joined, sizes)
    if sizes:  # sizes that do not add up, or cut a blob short
        sizes[-1] += size_error
        assert numpy_all_well_formed(joined, sizes) == wire.packed_all_well_formed(joined, sizes)


@pytest.mark.parametrize("steps", [3, NUMPY_FROM])
def test_a_block_of_well_formed_arrays_passes_and_one_bad_header_fails_it(steps: int) -> None:
    # Small blocks take the agent's loop, large ones numpy: either way the same answer.
    good = [wire.pack_step_arrays([[1, 2], [3, 4], [5, 6], [7, 8], [0, 1], [9, 10]]) for _ in range(steps)]
    assert all_well_formed(b"".join(good), [len(b) for b in good])
    bad = good[:1] + [b"\x02" + good[1][1:]] + good[2:]
    assert not all_well_formed(b"".join(bad), [len(b) for b in bad])
