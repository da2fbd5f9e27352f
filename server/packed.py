"""The wire format's packed step arrays (``records.pack_step_arrays``) seen through numpy.

The agent's module reads one blob at a time in pure Python (the agent must not need numpy); the
collector reads thousands at once: every header of an ingested step block when it validates it, and
the arrays of a page of stored rows when it computes the steps view (``step_page``). Here a header is a
numpy record, so those are a few array operations whatever the number of blobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ddpscope.agent import records as wire

HEADER = np.dtype(
    [("version", "u1")]
    + [
        field
        for i in range(len(wire.STEP_ARRAYS))
        for field in ((f"n{i}", "<u4"), (f"w{i}", "u1"), (f"b{i}", "<i8"))
    ]
)
"""``records._PACK_HEADER`` as a numpy record: the version, then per array its length, width and base."""
assert HEADER.itemsize == wire._PACK_HEADER_SIZE, "the numpy header must match the wire format's"

_WIDTH_ALLOWED = np.zeros(256, np.bool_)
_WIDTH_ALLOWED[sorted(wire._WIDTHS)] = True
"""Indexed by a header's width byte: whether the width is one the wire format knows (a table lookup is
~8x cheaper than ``np.isin``)."""
NUMPY_FROM = 128
"""Blocks of fewer steps are checked by the agent's pure-Python loop: numpy's fixed cost (~100 µs a
block) is more than that loop's below ~100 headers. At 1,000 steps: 0.5 ms against 1.1 ms."""


def all_well_formed(blobs: bytes, sizes: Sequence[int]) -> bool:
    """``records.packed_all_well_formed`` for a whole step block in numpy: the same rules, the same
    answer (``tests/server/test_packed.py`` checks both on the same inputs)."""
    if len(sizes) < NUMPY_FROM:
        return wire.packed_all_well_formed(blobs, sizes)
    return numpy_all_well_formed(blobs, sizes)


def numpy_all_well_formed(blobs: bytes, sizes: Sequence[int]) -> bool:
    """The numpy check itself, whatever the number of steps."""
    if not sizes or min(sizes) < HEADER.itemsize or sum(sizes) != len(blobs):
        return False
    size = np.array(sizes, np.int64)
    starts = np.cumsum(size) - size
    # Every header's bytes gathered into one (steps, header) array, then read as records.
    raw = np.frombuffer(blobs, np.uint8)
    head = raw[starts[:, None] + np.arange(HEADER.itemsize)].view(HEADER).reshape(-1)
    if not (head["version"] == wire.PACK_VERSION).all():
        return False
    expected = np.full(len(size), HEADER.itemsize, np.int64)
    for i in range(len(wire.STEP_ARRAYS)):
        width = head[f"w{i}"]
        if not _WIDTH_ALLOWED[width].all() or int(head[f"b{i}"].max()) > wire._SAFE_BASE:
            return False
        expected += head[f"n{i}"].astype(np.int64) * width.astype(np.int64)
    return bool((expected == size).all())
