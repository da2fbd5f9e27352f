"""Step records travel in columns (``step_block``), each body gzipped only when that halves it."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from ddpscope import agent
from ddpscope.agent import records as wire
from ddpscope.agent import step_block
from ddpscope.agent.transport import batch_body, encode_records, is_gzip
from ddpscope.server.body import decode_content
from ddpscope.server.codec import BatchError, decode_batch
from tests.agent.test_faults import configure, heartbeat


def step(i: int, *, stream: str = "s0", rank: int = 0, buckets: int = 3) -> dict[str, Any]:
    t = 1_700_000_000_000_000_000 + i * 10_000_000
    ready = [t + 2_000_000 + b * 100_000 + i for b in range(buckets)]
    return {
        "kind": "step", "job": "j", "rank": rank, "stream": stream, "seq": i, "time_ns": t + 9_000_000,
        "step": i, "synced": i % 4 != 3, "forward_start_ns": t, "forward_end_ns": t + 1_000_000,
        "backward_start_ns": t + 1_000_000, "backward_end_ns": t + 8_000_000,
        "bucket_ready_ns": ready, "allreduce_start_ns": [x + 7 for x in ready],
        "allreduce_end_ns": [x + 50_000 for x in ready], "bucket_bytes": [4096] * buckets,
        "ready_order": list(range(buckets)), "collective_seqs": [i * buckets + b + 1 for b in range(buckets)],
        "unused_parameters": ["head.bias"] if i == 2 else [],
        **({"blocked_forward_ns": 1234} if i == 1 else {}),
    }  # fmt: skip


def _as_read(record: dict[str, Any]) -> dict[str, Any]:
    """A step record as its block gives it back: absent blocked times are 0."""
    return {**{name: 0 for name in wire.BLOCKED_FIELDS}, **record}


def _items(body: bytes) -> list[dict[str, Any]]:
    return json.loads(decode_content(body, "gzip" if is_gzip(body) else None, 1 << 30))["records"]


def test_a_block_expands_to_exactly_the_step_records_it_was_built_from():
    steps = [step(i) for i in range(6)]
    block, held = step_block.build(steps)
    assert block is not None and held == steps
    assert (block["seq"], block["time_ns"], block["count"]) == (0, steps[-1]["time_ns"], 6)
    assert block["unused"] == [{"index": 2, "names": ["head.bias"]}]
    wire.validate_record(block)
    assert step_block.expand(block) == [_as_read(r) for r in steps]


def test_the_collector_decodes_a_block_into_the_rows_of_its_steps():
    from ddpscope.server.rows import block_rows, step_row

    steps = [step(i) for i in range(5)]
    items, _ = encode_records(steps)
    (block,) = decode_batch(b'{"schema":1,"records":[%s]}' % items)
    one_by_one = decode_batch(b'{"schema":1,"records":[%s]}' % encode_records(steps, step_blocks=False)[0])
    assert block_rows(7, block) == [step_row(7, r) for r in one_by_one]


def test_steps_of_each_stream_make_one_block_in_the_place_of_their_first_step():
    records = [
        heartbeat(1),
        step(0),
        step(0, stream="s1", rank=1),
        heartbeat(2),
        step(1),
        step(1, stream="s1", rank=1),
    ]
    items, shipped = encode_records(records)
    assert shipped == records
    kinds = [(r["kind"], r.get("stream"), r.get("count")) for r in json.loads(b"[%s]" % items)]
    assert kinds == [
        ("heartbeat", None, None),
        ("step_block", "s0", 2),
        ("step_block", "s1", 2),
        ("heartbeat", None, None),
    ]


def test_a_step_that_cannot_be_packed_travels_alone_so_the_collector_can_name_what_is_wrong():
    bad = {**step(1), "forward_start_ns": 1.5}  # a float: no int64 column holds it
    items, shipped = encode_records([step(0), bad, step(2)])
    assert shipped == [step(0), bad, step(2)]
    first, alone = json.loads(b"[%s]" % items)
    assert (first["kind"], first["count"], alone["kind"], alone["seq"]) == ("step_block", 2, "step", 1)
    with pytest.raises(BatchError, match=r"records\[1\]\.forward_start_ns"):
        decode_batch(b'{"schema":1,"records":[%s]}' % items)


def _broken(**change: Any) -> dict[str, Any]:
    block, _ = step_block.build([step(i) for i in range(4)])
    assert block is not None
    return {**block, **change}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _columns_of(block: dict[str, Any]) -> bytes:
    return base64.b64decode(block["columns"])


BROKEN = {
    "count": (_broken(count=0), "count: 0 steps"),
    "columns": (_broken(columns=_b64(b"\0" * 8)), "columns: 8 bytes, but 4 steps"),
    "array_sizes": (_broken(array_sizes=[1, 2]), "array_sizes: 2 sizes for 4 steps"),
    "arrays": (_broken(arrays=_b64(b"\1" * 9)), "arrays: 9 bytes, but array_sizes add up to"),
    "seq": (_broken(columns=_b64(b"\xff" * 8 + _columns_of(_broken())[8:])), "columns: a seq is negative"),
    "synced": (
        _broken(
            columns=_b64(
                _columns_of(_broken())[:96] + (7).to_bytes(8, "little") + _columns_of(_broken())[104:]
            )
        ),
        "columns: synced must be 0 or 1",
    ),
    "unused": (_broken(unused=[{"index": 4, "names": ["x"]}]), "unused: index 4 is outside"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_block_is_refused_by_both_validators_naming_the_field(case):
    block, message = BROKEN[case]
    with pytest.raises(wire.RecordError, match=message):
        wire.validate_record(block, "records[0]")
    with pytest.raises(BatchError, match=r"batch\.records\[0\]\." + message):
        decode_batch(json.dumps({"schema": 1, "records": [block]}).encode())


def test_a_block_whose_step_arrays_are_malformed_names_the_step():
    block, _ = step_block.build([step(i) for i in range(3)])
    assert block is not None
    arrays = bytearray(base64.b64decode(block["arrays"]))
    arrays[block["array_sizes"][0]] = 9  # the second step's packing version
    broken = {**block, "arrays": _b64(bytes(arrays))}
    with pytest.raises(BatchError, match=r"arrays: step 1 of the block: packed arrays of format version 9"):
        decode_batch(json.dumps({"schema": 1, "records": [broken]}).encode())


def test_a_body_is_gzipped_only_when_that_at_least_halves_it():
    beats = [json.dumps(heartbeat(i) | {"job": "j", "rank": 0, "stream": "s", "seq": i, "time_ns": i}).encode()
             for i in range(400)]  # fmt: skip
    json_body = batch_body(beats)
    assert is_gzip(json_body)
    steps = [step(i, buckets=50) for i in range(400)]
    block_body = batch_body([encode_records(steps)[0]])
    assert not is_gzip(block_body), "packed nanosecond times: gzip would not halve them"
    assert len(_items(block_body)) == 1 and len(_items(json_body)) == 400


@pytest.mark.parametrize("pipeline", ["spool", "http"])
def test_the_agent_ships_steps_in_blocks_and_every_step_arrives(pipeline, collector, spool_dir) -> None:
    a = configure(pipeline, collector, spool_dir)
    sent = [
        {k: v for k, v in step(i).items() if k not in ("job", "rank", "stream", "seq", "time_ns")}
        for i in range(30)
    ]
    for record in sent:
        agent.emit(dict(record))
    assert a.force_flush(10.0)
    got = collector.of_kind("step")
    assert [r["step"] for r in got] == list(range(30))
    assert collector.step_blocks >= 1
    assert [r["unused_parameters"] for r in got if r["unused_parameters"]] == [["head.bias"]]


@pytest.mark.parametrize("pipeline", ["spool", "http"])
def test_a_collector_older_than_step_blocks_gets_the_steps_one_by_one(pipeline, collector, spool_dir) -> None:
    collector.unknown_kinds = {"step_block"}
    a = configure(pipeline, collector, spool_dir)
    for i in range(10):
        agent.emit({k: v for k, v in step(i).items() if k not in ("job", "rank", "stream", "seq", "time_ns")})
        agent.emit(heartbeat(i))
    assert a.force_flush(10.0)
    assert [r["step"] for r in collector.of_kind("step")] == list(range(10))
    assert collector.unknown_refusals == 1 and collector.step_blocks == 0
    assert collector.dropped_total() == 0, "nothing is lost: the steps go as step records"
