"""The fast msgspec decoder must accept and reject exactly what the wire format's own validator does."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from ddpscope.agent import records as wire
from ddpscope.agent import step_block
from ddpscope.server.codec import STRUCTS, BatchError, decode_batch, to_wire
from tests.support.synth import batch, synth_job


def _hang() -> dict[str, Any]:
    return {
        "kind": "hang", "job": "j", "rank": 1, "stream": "s", "seq": 3, "time_ns": 10,
        "phase": "allreduce", "step": 4, "stalled_s": 30.0,
        "pending_buckets": [{"index": 0, "missing": ["fc.weight"], "launched": False}],
        "inflight": [{"pg": "default", "coll_seq": 9, "op": "all_reduce", "call_site": None, "start_ns": 5}],
        "stacks": [{"thread": "MainThread", "stack": "..."}],
        "message": "stuck",
    }  # fmt: skip


def _samples() -> list[dict[str, Any]]:
    recs = synth_job(2, 2, 3, unused={1: ["x.bias"]})
    recs.append(wire.packed_step_record(next(r for r in recs if r["kind"] == "step")))
    block, _ = step_block.build([r for r in recs if r["kind"] == "step" and r["rank"] == 1])
    recs.append(block)  # with unused parameters
    recs.append(_hang())
    recs.append(
        {
            "kind": "hang_resolved",
            "job": "j",
            "rank": 1,
            "stream": "s",
            "seq": 4,
            "time_ns": 11,
            "step": 4,
            "hang_s": 2,
        }
    )
    recs.append(
        {"kind": "rank_error", "job": "j", "rank": 0, "stream": "s", "seq": 5, "time_ns": 12, "step": None,
         "phase": "forward", "error_type": "RuntimeError", "message": "boom", "stack": "tb", "fatal": True}
    )  # fmt: skip
    return recs


def _accepts_fast(record: Any) -> bool:
    try:
        decode_batch(json.dumps(batch([record])).encode())
    except BatchError:
        return False
    return True


def _accepts_reference(record: Any) -> bool:
    try:
        wire.validate_record(record)
    except wire.RecordError:
        return False
    return True


def _mutations(record: dict[str, Any]) -> list[tuple[str, Any]]:
    """(description, mutated record): every field dropped, nulled and given a wrong type."""
    out: list[tuple[str, Any]] = []
    for name, value in record.items():
        dropped = {k: v for k, v in record.items() if k != name}
        out.append((f"drop {name}", dropped))
        out.append((f"null {name}", {**record, name: None}))
        wrong: Any = "text" if not isinstance(value, str) else 7
        out.append((f"wrong type {name}", {**record, name: wrong}))
        if isinstance(value, list) and value:
            out.append((f"wrong item {name}", {**record, name: [{"nested": True}]}))
        if isinstance(value, int) and not isinstance(value, bool):
            out.append((f"bool for int {name}", {**record, name: True}))
            out.append((f"negative {name}", {**record, name: -1}))
    return out


def test_every_record_kind_has_a_generated_struct():
    assert set(STRUCTS) == set(wire.RECORD_KINDS)


@pytest.mark.parametrize("record", _samples(), ids=lambda r: r["kind"])
def test_the_fast_decoder_agrees_with_the_reference_validator_on_every_mutation(record):
    assert _accepts_fast(record) and _accepts_reference(record)
    for what, mutated in _mutations(record):
        assert _accepts_fast(mutated) == _accepts_reference(mutated), what


def test_a_decoded_record_turns_back_into_the_same_wire_dict():
    for record in _samples():
        (decoded,) = decode_batch(json.dumps(batch([record])).encode())
        assert to_wire(decoded) == record


def test_unknown_extra_fields_are_accepted_as_the_reference_does():
    record = {**synth_job(1, 1, 1)[0], "from_a_newer_agent": 1}
    assert _accepts_fast(record) and _accepts_reference(record)


def test_errors_name_the_record_and_the_field():
    records = synth_job(1, 1, 2)
    bad = copy.deepcopy(records)
    step = next(i for i, r in enumerate(bad) if r["kind"] == "step")
    bad[step]["bucket_ready_ns"] = [1, "late"]
    with pytest.raises(BatchError, match=rf"records\[{step}\]\.bucket_ready_ns\[1\]"):
        decode_batch(json.dumps(batch(bad)).encode())
    bad[step]["bucket_ready_ns"] = [1, 2]
    del bad[step]["synced"]
    with pytest.raises(BatchError, match="synced"):
        decode_batch(json.dumps(batch(bad)).encode())


@pytest.mark.parametrize("job", ["a/b", ".", "..", "/"])
def test_a_job_id_that_could_never_be_opened_is_refused_by_both_validators_saying_why(job: str) -> None:
    # Stored, it would be listed by the API but no URL could name it.
    record = {**synth_job(1, 1, 1)[0], "job": job}
    assert not _accepts_reference(record)
    with pytest.raises(BatchError, match=r"records\[0\]\.job: a job id must be 1-200 characters with no '/'"):
        decode_batch(json.dumps(batch([record])).encode())
    assert _accepts_fast({**record, "job": "run.2026-11-23 é"}) and _accepts_reference(
        {**record, "job": "x.y"}
    )


def test_a_batch_of_another_schema_version_is_refused_with_the_version_named():
    with pytest.raises(BatchError, match="version 2 is not supported"):
        decode_batch(json.dumps({"schema": 2, "records": [{"kind": "future"}]}).encode())


def test_malformed_json_is_reported_as_such():
    with pytest.raises(BatchError, match="not valid JSON"):
        decode_batch(b'{"schema": 1, "records": [')


def _packed_step() -> dict[str, Any]:
    return wire.packed_step_record(next(r for r in synth_job(1, 1, 1) if r["kind"] == "step"))


def test_a_packed_step_decodes_to_the_same_arrays_as_its_lists():
    lists = next(r for r in synth_job(1, 1, 1) if r["kind"] == "step")
    (decoded,) = decode_batch(json.dumps(batch([wire.packed_step_record(lists)])).encode())
    assert wire.unpack_step_arrays(decoded.arrays) == tuple(lists[n] for n in wire.STEP_ARRAYS)


def test_packed_arrays_whose_length_disagrees_with_their_header_are_refused_naming_the_field():
    record = _packed_step()
    blob = base64.b64decode(record["arrays"])
    for bad in (blob[:-8], blob + bytes(8), blob[:10], b"\x02" + blob[1:]):
        bad_record = {**record, "arrays": base64.b64encode(bad).decode()}
        assert not _accepts_reference(bad_record)
        with pytest.raises(BatchError, match=r"records\[0\]\.arrays"):
            decode_batch(json.dumps(batch([bad_record])).encode())


def test_a_step_with_both_forms_or_neither_is_refused_by_both_validators():
    packed = _packed_step()
    lists = next(r for r in synth_job(1, 1, 1) if r["kind"] == "step")
    both = {**lists, "arrays": packed["arrays"]}
    neither = {k: v for k, v in lists.items() if k not in wire.STEP_ARRAYS}
    for record in (both, neither):
        assert not _accepts_fast(record) and not _accepts_reference(record)


def test_packing_refuses_values_beyond_int64_and_leaves_the_record_for_validation_to_name():
    lists = next(r for r in synth_job(1, 1, 1) if r["kind"] == "step")
    huge = {**lists, "bucket_bytes": [2**63]}
    assert wire.packed_step_record(huge) == huge
    with pytest.raises(wire.RecordError, match="bucket_bytes"):
        wire.validate_record(huge)


def test_a_rank_or_world_size_beyond_the_integer_columns_is_refused_by_both_validators():
    # PostgreSQL stores ranks and world sizes as INTEGER: more would be a database error (a 503 the agent
    # retries forever) instead of a 422 naming the field. Found by the ingest fuzzer on PostgreSQL.
    start = next(r for r in synth_job(1, 1, 1) if r["kind"] == "rank_start")
    for record, ok in (
        ({**start, "rank": 2**31 - 1}, True),
        ({**start, "rank": 2**31}, False),
        ({**start, "world_size": 2**31}, False),
        ({**start, "world_size": 2**31 - 1}, True),
    ):
        assert (_accepts_fast(record), _accepts_reference(record)) == (ok, ok), record
