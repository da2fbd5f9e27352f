"""Step records in columns: the ``step_block`` record, which is how the agent ships step records.

A step record as JSON costs the collector a parsed object, a dozen keys and a Python object per
record, more than storing its row. A block carries the step records of one stream as columns: the
scalar fields as one blob of little-endian int64 columns, every step's packed bucket arrays
(``records.pack_step_arrays``) one after the other, and the few steps with unused parameters apart.
The collector turns a block into table rows with C-level ``zip`` and never builds a record per step.

A block is exactly the step records it expands to (``expand``); the envelope's ``seq`` is its first
step's and its ``time_ns`` its newest step's. Standard library only, as ``records``.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpscope.agent import records as wire

COLUMNS = (
    "seq",
    "time_ns",
    "step",
    "synced",
    "forward_start_ns",
    "forward_end_ns",
    "backward_start_ns",
    "backward_end_ns",
    *wire.BLOCKED_FIELDS,
)
"""The scalar fields of a step, in the order of a block's ``columns`` (``synced`` as 0 or 1)."""
_OPTIONAL = frozenset(wire.BLOCKED_FIELDS)
MAX_STEPS = 100_000
"""Steps in one block at most: a bound on what one record may ask the collector to expand."""
_BIG_ENDIAN = sys.byteorder == "big"


def build(steps: Sequence[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """One block for step records of one ``(job, rank, stream)``, and the records it holds.

    A record that cannot travel (a missing or non-integer field, a value beyond int64) is left out, and
    the caller learns it from the second value; ``(None, [])`` when none can."""
    held: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for record in steps:
        try:
            blobs.append(wire.pack_step_arrays([record[name] for name in wire.STEP_ARRAYS]))
        except (KeyError, TypeError, OverflowError):
            continue
        held.append(record)
    try:
        columns = _columns(held)
    except (KeyError, TypeError, OverflowError):
        # Rare: find the records at fault one by one, keep the others.
        keep = [i for i, r in enumerate(held) if _fits(r)]
        held, blobs = [held[i] for i in keep], [blobs[i] for i in keep]
        columns = _columns(held)
    if not held:
        return None, []
    first = held[0]
    block = {
        "kind": "step_block",
        "job": first["job"],
        "rank": first["rank"],
        "stream": first["stream"],
        "seq": first["seq"],
        "time_ns": max(r["time_ns"] for r in held),
        "count": len(held),
        "columns": base64.b64encode(columns).decode("ascii"),
        "arrays": base64.b64encode(b"".join(blobs)).decode("ascii"),
        "array_sizes": [len(b) for b in blobs],
        "unused": [
            {"index": i, "names": list(r["unused_parameters"])}
            for i, r in enumerate(held)
            if r.get("unused_parameters")
        ],
    }
    return block, held


def _columns(steps: Sequence[Mapping[str, Any]]) -> bytes:
    out = array("q")
    for name in COLUMNS:
        if name in _OPTIONAL:
            values = array("q", [r.get(name, 0) for r in steps])
        else:
            values = array("q", [r[name] for r in steps])  # bool synced -> 0/1; a float raises TypeError
        out.extend(values)
    if _BIG_ENDIAN:
        out.byteswap()
    return out.tobytes()


def _fits(record: Mapping[str, Any]) -> bool:
    try:
        _columns([record])
    except (KeyError, TypeError, OverflowError):
        return False
    return True


def columns(count: int, blob: bytes) -> list[array[int]]:
    """A well-formed block's ``columns`` blob -> one int64 array per name of ``COLUMNS``."""
    values = array("q", blob)
    if _BIG_ENDIAN:
        values.byteswap()
    return [values[i * count : (i + 1) * count] for i in range(len(COLUMNS))]


def split_arrays(blob: bytes, sizes: Sequence[int]) -> list[bytes]:
    """Each step's packed arrays, from the block's ``arrays`` and ``array_sizes``."""
    out, at = [], 0
    for size in sizes:
        out.append(blob[at : at + size])
        at += size
    return out


def problem(
    count: int,
    blob: bytes,
    arrays: bytes,
    sizes: Sequence[int],
    unused_at: Sequence[int],
    all_well_formed: Callable[[bytes, Sequence[int]], bool] = wire.packed_all_well_formed,
) -> str | None:
    """What is wrong with a block, as ``"<field>: <what>"``, or None. Types are checked already.
    ``all_well_formed`` answers for every step's packed arrays at once (the collector passes its numpy
    twin of ``records.packed_all_well_formed``); the step at fault is then named one by one."""
    if not 1 <= count <= MAX_STEPS:
        return f"count: {count} steps; a block holds 1 to {MAX_STEPS}"
    width = 8 * len(COLUMNS)
    if len(blob) != width * count:
        return f"columns: {len(blob)} bytes, but {count} steps of {len(COLUMNS)} int64 columns are {width * count}"
    if len(sizes) != count:
        return f"array_sizes: {len(sizes)} sizes for {count} steps"
    if sum(sizes) != len(arrays):
        return f"arrays: {len(arrays)} bytes, but array_sizes add up to {sum(sizes)}"
    cols = columns(count, blob)
    if min(cols[0]) < 0:
        return "columns: a seq is negative; seq counts up from 0"
    if not set(cols[COLUMNS.index("synced")]) <= {0, 1}:
        return "columns: synced must be 0 or 1"
    if not all_well_formed(arrays, sizes):  # then find the first at fault, to name it
        for i, step_arrays in enumerate(split_arrays(arrays, sizes)):
            detail = wire.packed_problem(step_arrays)
            if detail:
                return f"arrays: step {i} of the block: {detail}"
    bad = [i for i in unused_at if not 0 <= i < count]
    if bad:
        return f"unused: index {bad[0]} is outside the block's {count} steps"
    return None


def expand(block: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The step records a block (as a wire dict, base64 text and all) stands for, arrays as lists."""
    count = block["count"]
    blob = base64.b64decode(block["columns"])
    arrays = base64.b64decode(block["arrays"])
    unused = {u["index"]: list(u["names"]) for u in block.get("unused", ())}
    cols = columns(count, blob)
    out = []
    for i, step_arrays in enumerate(split_arrays(arrays, block["array_sizes"])):
        record: dict[str, Any] = {
            "kind": "step",
            "job": block["job"],
            "rank": block["rank"],
            "stream": block["stream"],
        }
        for name, values in zip(COLUMNS, cols, strict=True):
            record[name] = values[i]
        record["synced"] = bool(record["synced"])
        record.update(zip(wire.STEP_ARRAYS, wire.unpack_step_arrays(step_arrays), strict=True))
        record["unused_parameters"] = unused.get(i, [])
        out.append(record)
    return out
