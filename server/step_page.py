"""A page of stored step rows as columns: what the steps view computes over, decoded in a few numpy calls.

The per-step metrics read three arrays of every row: the buckets' ready times and the all-reduce spans.
Decoding them row by row into Python values cost more than the database query itself for a page of
hundreds of rows (30 µs a row of 50 buckets). Here each array becomes one (rows x buckets) int64 matrix,
built from the packed blobs (``records.pack_step_arrays``) with one ``frombuffer`` per array and byte
width, whatever the number of rows.

Rows with fewer buckets than the widest are padded with ``PAD``, the smallest int64. A padded bucket
is never the last ready one, and a padded span has no length (``analysis.steps.page_metrics``). A
span counts only where a row has both its start and its end, as ``zip`` pairs them in
``analysis.steps.union_after``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ddpscope.agent import step_block
from ddpscope.server.packed import HEADER
from ddpscope.server.rows import StepTimes

Ints = npt.NDArray[np.int64]

PAD = int(np.iinfo(np.int64).min)
"""Fills a row's matrix positions beyond its own number of buckets."""

SCALARS = ("rank", *step_block.COLUMNS[2:])  # step, synced, forward and backward times, blocked times
"""The step columns a page holds besides ``arrays``, in the order ``from_db`` expects them."""

_LITTLE_ENDIAN = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<i8"}


@dataclass(frozen=True, slots=True)
class StepPage:
    """Step rows as columns, in query order. ``ready``, ``starts`` and ``ends`` are (rows, buckets)
    matrices padded with ``PAD``; ``ready_count`` and ``span_count`` are each row's own numbers."""

    rank: Ints
    step: Ints
    synced: npt.NDArray[np.bool_]
    forward_start_ns: Ints
    forward_end_ns: Ints
    backward_start_ns: Ints
    backward_end_ns: Ints
    blocked_between_ns: Ints
    blocked_forward_ns: Ints
    blocked_backward_ns: Ints
    ready: Ints
    ready_count: Ints
    starts: Ints
    ends: Ints
    span_count: Ints

    def __len__(self) -> int:
        return len(self.rank)

    def head(self, n: int) -> StepPage:
        """The first ``n`` rows."""
        return StepPage(*(getattr(self, name)[:n] for name in self.__slots__))

    @classmethod
    def from_db(cls, rows: Sequence[Sequence[Any]]) -> StepPage:
        """Rows of ``(*SCALARS, arrays)`` as stored: every blob was checked at ingest
        (``records.packed_problem``), so the headers are trusted here."""
        if not rows:
            e, none = np.zeros(0, np.int64), np.zeros((0, 0), np.int64)
            return cls(e, e, e.astype(bool), e, e, e, e, e, e, e, none, e, none, none, e)
        columns = list(zip(*rows, strict=True))
        blobs = columns[len(SCALARS)]
        header = np.frombuffer(b"".join([blob[: HEADER.itemsize] for blob in blobs]), HEADER)
        offsets = np.full(len(blobs), HEADER.itemsize, np.int64)
        matrices, counts = [], []
        for i in range(3):  # STEP_ARRAYS order: ready, start, end first
            count = header[f"n{i}"].astype(np.int64)
            width = header[f"w{i}"].astype(np.int64)
            matrices.append(_matrix(blobs, offsets, count, width, header[f"b{i}"].astype(np.int64)))
            counts.append(count)
            offsets += count * width
        ready, starts, ends = matrices
        # A span is a (start, end) pair: only as many as the shorter of the two arrays.
        spans = min(starts.shape[1], ends.shape[1])
        starts, ends = starts[:, :spans], ends[:, :spans]
        span_count = np.minimum(counts[1], counts[2])
        unpaired = np.arange(spans) >= span_count[:, None]
        starts[unpaired] = PAD
        ends[unpaired] = PAD
        rank, step, synced, fs, fe, bs, be, between, forward, backward = (
            np.array(c, np.int64) for c in columns[: len(SCALARS)]
        )
        return cls(
            rank, step, synced.astype(bool), fs, fe, bs, be, between, forward, backward,
            ready, counts[0], starts, ends, span_count,
        )  # fmt: skip

    def rows(self) -> list[StepTimes]:
        """The page as ``StepTimes`` rows, for ``analysis.steps.step_metrics`` row by row (where a row's
        times lie too far apart for the page's float64 arithmetic to stay exact)."""
        out = []
        for i in range(len(self)):
            spans = int(self.span_count[i])
            out.append(
                StepTimes(
                    int(self.rank[i]),
                    int(self.step[i]),
                    bool(self.synced[i]),
                    int(self.forward_start_ns[i]),
                    int(self.forward_end_ns[i]),
                    int(self.backward_start_ns[i]),
                    int(self.backward_end_ns[i]),
                    self.ready[i, : self.ready_count[i]].tolist(),
                    self.starts[i, :spans].tolist(),
                    self.ends[i, :spans].tolist(),
                    int(self.blocked_between_ns[i]),
                    int(self.blocked_forward_ns[i]),
                    int(self.blocked_backward_ns[i]),
                )
            )
        return out


def _matrix(blobs: Sequence[bytes], offsets: Ints, count: Ints, width: Ints, base: Ints) -> Ints:
    """One packed array of every row as a (rows, longest) matrix padded with ``PAD``.

    A value stored in 1, 2 or 4 bytes is its low bytes; it is ``base`` plus its offset from the base's
    low bytes, modulo the width (``records._restore``). The collector bounds bases so that this never
    leaves int64 (``records._BASE_LIMIT``)."""
    longest = int(count.max())
    out = np.full((len(blobs), longest), PAD, np.int64)
    filled = np.arange(longest) < count[:, None]
    for w in np.unique(width).tolist():
        rows = np.flatnonzero(width == w)
        row_counts = count[rows]
        if w == 0:  # every value is the base
            values = np.repeat(base[rows], row_counts)
        else:
            data = b"".join(
                [
                    blobs[r][at : at + n * w]
                    for r, at, n in zip(
                        rows.tolist(), offsets[rows].tolist(), row_counts.tolist(), strict=True
                    )
                ]
            )
            low = np.frombuffer(data, _LITTLE_ENDIAN[w]).astype(np.int64)
            if w == 8:
                values = low
            else:
                mask = (1 << 8 * w) - 1
                bases = np.repeat(base[rows], row_counts)
                values = bases + ((low - (bases & mask)) & mask)
        if len(rows) == len(blobs):
            out[filled] = values
        else:
            part = out[rows]
            part[filled[rows]] = values
            out[rows] = part
    return out
