"""Decoded records -> table rows, and stored rows -> wire-shaped dicts.

Kept apart from storage so the benchmark's raw ``sqlite3.executemany`` ceiling inserts exactly the
rows the collector inserts. The per-bucket arrays of a step are stored as the wire format's packed blob
(``records.pack_step_arrays``): a step that arrives packed, as the agent sends it, is stored without
being unpacked; one that arrives as lists is packed once here.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import msgspec

from ddpscope.agent import records as wire
from ddpscope.agent import step_block

STEP_ARRAYS = wire.STEP_ARRAYS
"""The step fields packed into ``steps.arrays``, in blob order."""

STEP_COLUMNS = ("job_id", "rank", "stream", *step_block.COLUMNS[:8], "arrays", *step_block.COLUMNS[8:])
"""Column order of a step row tuple: a step block's columns with the key in front and the arrays among them
(``block_rows`` zips a block into rows in this order)."""

_UNSET = msgspec.UNSET
_json = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


def step_row(job_id: int, r: Any) -> tuple[Any, ...]:
    """One decoded step Struct -> a ``steps`` row tuple (``STEP_COLUMNS`` order)."""
    return (
        job_id,
        r.rank,
        r.stream,
        r.seq,
        r.time_ns,
        r.step,
        r.synced,
        r.forward_start_ns,
        r.forward_end_ns,
        r.backward_start_ns,
        r.backward_end_ns,
        r.arrays
        if r.arrays is not _UNSET  # checked by the codec (``records.packed_problem``): stored as sent
        else wire.pack_step_arrays(
            (
                r.bucket_ready_ns,
                r.allreduce_start_ns,
                r.allreduce_end_ns,
                r.bucket_bytes,
                r.ready_order,
                r.collective_seqs,
            )
        ),
        0 if r.blocked_between_ns is _UNSET else r.blocked_between_ns,  # an older agent: nothing measured
        0 if r.blocked_forward_ns is _UNSET else r.blocked_forward_ns,
        0 if r.blocked_backward_ns is _UNSET else r.blocked_backward_ns,
    )


def block_rows(job_id: int, block: Any) -> list[tuple[Any, ...]]:
    """One decoded ``step_block`` Struct -> its ``steps`` row tuples, built in C (no object per step)."""
    n = block.count
    seq, time_ns, step, synced, fs, fe, bs, be, *blocked = step_block.columns(n, block.columns)
    arrays = step_block.split_arrays(block.arrays, block.array_sizes)
    return list(
        zip(
            repeat(job_id, n), repeat(block.rank, n), repeat(block.stream, n), seq, time_ns, step,
            map(bool, synced), fs, fe, bs, be, arrays, *blocked, strict=True,
        )
    )  # fmt: skip


def block_unused(block: Any) -> list[tuple[int, int, list[str]]]:
    """``(seq, step, names)`` of a block's steps with unused parameters."""
    if not block.unused:
        return []
    cols = step_block.columns(block.count, block.columns)
    seq, step = cols[step_block.COLUMNS.index("seq")], cols[step_block.COLUMNS.index("step")]
    return [(seq[u.index], step[u.index], u.names) for u in block.unused]


def unpack_arrays(blob: bytes) -> tuple[list[int], ...]:
    return wire.unpack_step_arrays(bytes(blob))


def encode_json(obj: Any) -> str:
    return _json(obj).decode()


def decode_json(text: str | bytes) -> Any:
    return _json_decode(text)


@dataclass(slots=True)
class StepRow:
    """A stored step record: the scalars plus the unpacked per-bucket arrays."""

    rank: int
    step: int
    synced: bool
    forward_start_ns: int
    forward_end_ns: int
    backward_start_ns: int
    backward_end_ns: int
    bucket_ready_ns: list[int]
    allreduce_start_ns: list[int]
    allreduce_end_ns: list[int]
    bucket_bytes: list[int]
    ready_order: list[int]
    collective_seqs: list[int]
    time_ns: int = 0
    stream: str = ""
    seq: int = 0
    unused_parameters: list[str] = field(default_factory=list)
    blocked_between_ns: int = 0
    blocked_forward_ns: int = 0
    blocked_backward_ns: int = 0

    @classmethod
    def from_db(cls, row: Any) -> StepRow:
        """From a ``steps`` row selected with ``STEP_READ_COLUMNS``."""
        ready, ar_start, ar_end, nbytes, order, seqs = unpack_arrays(row.arrays)
        return cls(
            rank=row.rank,
            step=row.step,
            synced=bool(row.synced),
            forward_start_ns=row.forward_start_ns,
            forward_end_ns=row.forward_end_ns,
            backward_start_ns=row.backward_start_ns,
            backward_end_ns=row.backward_end_ns,
            bucket_ready_ns=ready,
            allreduce_start_ns=ar_start,
            allreduce_end_ns=ar_end,
            bucket_bytes=nbytes,
            ready_order=order,
            collective_seqs=seqs,
            time_ns=row.time_ns,
            stream=row.stream,
            seq=row.seq,
            blocked_between_ns=row.blocked_between_ns,
            blocked_forward_ns=row.blocked_forward_ns,
            blocked_backward_ns=row.blocked_backward_ns,
        )

    @classmethod
    def from_wire(cls, r: dict[str, Any]) -> StepRow:
        if "arrays" in r:  # packed, as the agent ships it
            r = {
                **r,
                **dict(zip(STEP_ARRAYS, wire.unpack_step_arrays(base64.b64decode(r["arrays"])), strict=True)),
            }
        return cls(
            rank=r["rank"],
            step=r["step"],
            synced=r["synced"],
            forward_start_ns=r["forward_start_ns"],
            forward_end_ns=r["forward_end_ns"],
            backward_start_ns=r["backward_start_ns"],
            backward_end_ns=r["backward_end_ns"],
            bucket_ready_ns=list(r["bucket_ready_ns"]),
            allreduce_start_ns=list(r["allreduce_start_ns"]),
            allreduce_end_ns=list(r["allreduce_end_ns"]),
            bucket_bytes=list(r["bucket_bytes"]),
            ready_order=list(r["ready_order"]),
            collective_seqs=list(r["collective_seqs"]),
            time_ns=r["time_ns"],
            stream=r["stream"],
            seq=r["seq"],
            unused_parameters=list(r.get("unused_parameters", [])),
            blocked_between_ns=r.get("blocked_between_ns", 0),
            blocked_forward_ns=r.get("blocked_forward_ns", 0),
            blocked_backward_ns=r.get("blocked_backward_ns", 0),
        )

    def to_wire(self, job: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "step",
            "job": job,
            "rank": self.rank,
            "stream": self.stream,
            "seq": self.seq,
            "time_ns": self.time_ns,
            "step": self.step,
            "synced": self.synced,
            "forward_start_ns": self.forward_start_ns,
            "forward_end_ns": self.forward_end_ns,
            "backward_start_ns": self.backward_start_ns,
            "backward_end_ns": self.backward_end_ns,
            "blocked_between_ns": self.blocked_between_ns,
            "blocked_forward_ns": self.blocked_forward_ns,
            "blocked_backward_ns": self.blocked_backward_ns,
        }
        for name in STEP_ARRAYS:
            out[name] = getattr(self, name)
        out["unused_parameters"] = self.unused_parameters
        return out


@dataclass(slots=True)
class StepTimes:
    """What the per-step metrics read: the scalar times and three arrays."""

    rank: int
    step: int
    synced: bool
    forward_start_ns: int
    forward_end_ns: int
    backward_start_ns: int
    backward_end_ns: int
    ready: Sequence[int]
    starts: Sequence[int]
    ends: Sequence[int]
    blocked_between_ns: int = 0
    blocked_forward_ns: int = 0
    blocked_backward_ns: int = 0

    @classmethod
    def of(cls, r: StepRow) -> StepTimes:
        return cls(
            r.rank, r.step, r.synced, r.forward_start_ns, r.forward_end_ns, r.backward_start_ns,
            r.backward_end_ns, r.bucket_ready_ns, r.allreduce_start_ns, r.allreduce_end_ns,
            r.blocked_between_ns, r.blocked_forward_ns, r.blocked_backward_ns,
        )  # fmt: skip


def step_rows_from_wire(records: Iterable[dict[str, Any]]) -> list[StepRow]:
    return [StepRow.from_wire(r) for r in records if r["kind"] == "step"]
