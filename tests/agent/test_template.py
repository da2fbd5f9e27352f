"""Record templates: the engine's bucket all-reduce records, emitted as a few integers, must reach the
spool and the write-ahead ring as exactly the records ``emit_durable`` would have written, and a torn
slot must never be read as a record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddpscope import agent
from ddpscope.agent import ring
from ddpscope.agent._core import TEMPLATED_QUEUED
from ddpscope.agent.template import RecordTemplate
from tests.agent.conftest import spool_agent, spooled

FIXED = {
    "kind": "collective", "pg": "default", "op": "all_reduce", "reduce_op": "SUM", "shapes": [[16]],
    "dtypes": ["float32"], "call_site": None, "source": "engine",
}  # fmt: skip
VARIABLES = ("coll_seq", "start_ns", "step")


def template() -> RecordTemplate:
    return RecordTemplate(FIXED, VARIABLES, time_field="start_ns")


def frame() -> ring.TemplateFrame:
    encoded = ring.encode_template({"rank": 0, **FIXED, "job": "j", "stream": "s"}, VARIABLES)
    assert encoded is not None
    return encoded


def test_a_templated_record_is_the_record_emit_durable_writes_in_the_spool_and_in_the_ring(
    tmp_path: Path,
) -> None:
    a = spool_agent(tmp_path, "tpl")
    try:
        assert agent.emit_templated(template(), (7, 1_000, 3))
        assert agent.emit_durable({**FIXED, "coll_seq": 8, "start_ns": 2_000, "step": 3, "time_ns": 2_000})
        in_ring = sorted(ring.read_ring(str(tmp_path), a.exporter.prefix), key=lambda r: r["coll_seq"])
        assert a.flush_local(10.0)
        in_spool = sorted(
            (r for r in spooled(tmp_path) if r["kind"] == "collective"), key=lambda r: r["coll_seq"]
        )
        assert in_ring == in_spool
        templated, ordinary = in_spool
        envelope = ("seq", "coll_seq", "start_ns", "time_ns")
        assert {k: v for k, v in templated.items() if k not in envelope} == {
            k: v for k, v in ordinary.items() if k not in envelope
        }
        assert (templated["coll_seq"], templated["start_ns"], templated["time_ns"]) == (7, 1_000, 1_000)
        assert templated["stream"] == a.stream and templated["seq"] != ordinary["seq"]
    finally:
        agent.shutdown(2.0)


def test_a_non_durable_templated_record_skips_the_ring_but_reaches_the_spool(tmp_path: Path) -> None:
    end = RecordTemplate(
        {"kind": "collective_end", "pg": "default", "ok": True, "error": None}, ("coll_seq", "end_ns")
    )
    a = spool_agent(tmp_path, "tpl-end")
    try:
        agent.emit_templated(end, (4, 5_000), False)
        assert ring.read_ring(str(tmp_path), a.exporter.prefix) == []
        assert a.flush_local(10.0)
        (got,) = [r for r in spooled(tmp_path) if r["kind"] == "collective_end"]
        assert (got["coll_seq"], got["end_ns"], got["ok"]) == (4, 5_000, True)
    finally:
        agent.shutdown(2.0)


def test_an_exporter_in_memory_gets_the_same_record_built_by_the_worker() -> None:
    exporter = agent.InMemoryExporter()
    a = agent.configure(job="tpl-mem", rank=0, exporter=exporter, flush_interval_s=60)
    try:
        assert agent.emit_templated(template(), (2, 500, 1))
        assert len(a._queue) == 1 and a._queue[0][0] == TEMPLATED_QUEUED  # not built in the caller
        agent.emit_durable({**template().expand((3, 600, 1)), "time_ns": 600})
        assert a.flush_local(10.0)
        built, emitted = [r for r in exporter.records if r["kind"] == "collective"]
        assert (built["coll_seq"], built["start_ns"], built["step"], built["time_ns"]) == (2, 500, 1, 500)
        moving = ("seq", "coll_seq", "start_ns", "time_ns")
        assert {k: v for k, v in built.items() if k not in moving} == {
            k: v for k, v in emitted.items() if k not in moving
        }
    finally:
        agent.shutdown(2.0)


def test_the_wrong_number_of_values_is_dropped_and_counted_not_raised(tmp_path: Path) -> None:
    a = spool_agent(tmp_path, "tpl-bad")
    try:
        assert not agent.emit_templated(template(), (1, 2))
        assert a.stats()["dropped"] == {"invalid:collective": 1}
    finally:
        agent.shutdown(2.0)


@pytest.mark.parametrize(
    ("fixed", "variables", "problem"),
    [
        ({"kind": "nonsense"}, (), "unknown kind"),
        ({"kind": "hang"}, (), "urgent"),
        (FIXED, ("coll_seq", "op"), "both fixed and variable"),
        ({**FIXED, "shapes": "16"}, VARIABLES, "shapes"),
    ],
)
def test_a_template_that_cannot_make_a_valid_record_is_refused_when_made(
    fixed: dict[str, Any], variables: tuple[str, ...], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        RecordTemplate(fixed, variables)


INLINE = pytest.param(0, id="inline")
TABLED = pytest.param(ring.TABLE_ENTRIES, id="table")


@pytest.mark.parametrize("table_entries", [TABLED, INLINE])
def test_the_ring_reads_templated_records_back_after_wrapping_around(
    tmp_path: Path, table_entries: int
) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=4, table_entries=table_entries)
    f = frame()
    for seq in range(1, 11):
        assert w.put_templated(f, seq, 100 + seq, (seq, 100 + seq, 9))
    w.close()
    got = sorted(ring.read_ring(str(tmp_path), "p"), key=lambda r: r["seq"])
    assert [(r["seq"], r["coll_seq"], r["time_ns"], r["step"]) for r in got] == [
        (s, s, 100 + s, 9) for s in range(7, 11)
    ]
    assert all(r["shapes"] == [[16]] and r["job"] == "j" for r in got)


@pytest.mark.parametrize("table_entries", [TABLED, INLINE])
def test_ordinary_and_templated_records_take_turns_in_a_slot_without_ghosts(
    tmp_path: Path, table_entries: int
) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=1, table_entries=table_entries)
    f = frame()
    assert w.put_templated(f, 1, 1, (1, 1, 1))
    assert w.put({"kind": "heartbeat", "seq": 2, "x": "y" * 300})
    assert [r["seq"] for r in ring.read_ring(str(tmp_path), "p")] == [2]
    assert w.put_templated(f, 3, 3, (3, 3, 3))
    w.close()
    assert [(r["seq"], r["kind"]) for r in ring.read_ring(str(tmp_path), "p")] == [(3, "collective")]


def test_templates_past_the_full_table_travel_inline_and_every_record_reads_back(tmp_path: Path) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=8, table_entries=2)
    frames = [
        ring.encode_template({"rank": 0, **FIXED, "shapes": [[k]], "job": "j", "stream": "s"}, VARIABLES)
        for k in range(1, 5)
    ]
    for seq, f in enumerate(frames, 1):
        assert f is not None and w.put_templated(f, seq, seq, (seq, seq, 0))
    assert [f.ref is not None for f in frames if f is not None] == [True, True, False, False]
    w.close()
    got = sorted(ring.read_ring(str(tmp_path), "p"), key=lambda r: r["seq"])
    assert [(r["seq"], r["shapes"]) for r in got] == [(k, [[k]]) for k in range(1, 5)]


def test_a_frame_written_by_a_new_ring_gets_an_entry_in_that_ring(tmp_path: Path) -> None:
    f = frame()
    first = ring.WriteAheadRing(str(tmp_path), "a")
    assert first.put_templated(f, 1, 1, (1, 1, 1))
    first.close()
    second = ring.WriteAheadRing(str(tmp_path), "b")  # say, an agent rebuilt after a fork
    assert second.put_templated(f, 2, 2, (2, 2, 2))
    second.close()
    assert [r["seq"] for r in ring.read_ring(str(tmp_path), "b")] == [2]


def _torn(old: bytes, start: int, new: bytes, zeroed: int, written: int) -> bytes:
    """``old`` with the ``pack_into`` of ``new`` at ``start`` cut short: the span zeroed up to
    ``zeroed``, then (once all zeroed) ``written`` bytes of ``new`` copied."""
    torn = bytearray(old)
    end = start + len(new)
    torn[start : start + zeroed] = bytes(zeroed)
    if zeroed == len(new):
        torn[start:end] = new[:written] + bytes(len(new) - written)
    return bytes(torn)


def _one_record_ring(tmp_path: Path) -> tuple[ring.TemplateFrame, Path]:
    """A one-slot ring holding record seq 1 through the template table; its frame and file."""
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=1)
    f = frame()
    assert w.put_templated(f, 1, 10, (1, 10, 0))
    w.close()
    assert f.ref is not None
    return f, Path(ring.ring_path(str(tmp_path), "p"))


def test_a_slot_torn_at_any_byte_reads_back_as_the_old_record_or_nothing(tmp_path: Path) -> None:
    # A SIGKILL can land anywhere inside put_templated's pack_into, which zeroes its span (prefix and
    # integers) and then writes the fields in order: replay that write cut at every byte, over an older
    # record in the slot.
    f, path = _one_record_ring(tmp_path)
    old = path.read_bytes()
    new = f.ref[1].pack(ring.REF_MAGIC, f.ref[2], f.crc, 3, 2, 20, 2, 20, 0, ~2 ^ f.crc)
    seen = set()
    for zeroed, written in [(z, 0) for z in range(len(new))] + [(len(new), w) for w in range(len(new) + 1)]:
        path.write_bytes(_torn(old, 0, new, zeroed, written))
        got = [(r["seq"], r["coll_seq"], r["time_ns"]) for r in ring.read_ring(str(tmp_path), "p")]
        assert got in ([], [(1, 1, 10)], [(2, 2, 20)]), (zeroed, written, got)
        seen.add(tuple(got))
    assert seen == {((1, 1, 10),), (), ((2, 2, 20),)}  # the new record only from the complete write


def test_a_slot_naming_a_torn_or_different_table_entry_is_skipped(tmp_path: Path) -> None:
    f, path = _one_record_ring(tmp_path)
    good = path.read_bytes()
    entry = f.ref[2] * ring.SLOT_BYTES
    data = bytearray(good)
    data[entry + 20] ^= 0xFF  # the template torn (its crc fails)
    path.write_bytes(bytes(data))
    assert ring.read_ring(str(tmp_path), "p") == []
    other = ring.encode_template(
        {"rank": 0, **FIXED, "op": "broadcast", "job": "j", "stream": "s"}, VARIABLES
    )
    assert other is not None and other.crc != f.crc
    data = bytearray(good)  # the entry holds another template (a stale file, a wrong index)
    data[entry : entry + 16 + len(other.payload)] = (
        ring._TEMPLATE_PREFIX.pack(ring.TABLE_MAGIC, len(other.payload), other.crc, 3) + other.payload
    )
    path.write_bytes(bytes(data))
    assert ring.read_ring(str(tmp_path), "p") == []


def test_an_inline_slot_whose_template_changed_under_old_integers_is_skipped(tmp_path: Path) -> None:
    # Torn between a new template's prefix and its integers: the old integers' check names the old
    # template, so they are not read as the new one's values.
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=1, table_entries=0)
    other = ring.encode_template(
        {"rank": 0, **FIXED, "op": "broadcast", "job": "j", "stream": "s"}, VARIABLES
    )
    assert other is not None and other.crc != frame().crc
    assert w.put_templated(frame(), 1, 10, (1, 10, 0))
    w.close()
    path = Path(ring.ring_path(str(tmp_path), "p"))
    data = bytearray(path.read_bytes())
    body = 16 + other.ints.size
    data[body : body + len(other.payload)] = other.payload  # torn before the prefix: its crc fails
    path.write_bytes(bytes(data))
    assert ring.read_ring(str(tmp_path), "p") == []
    data[:16] = other.prefix  # torn before the integers: their check fails
    path.write_bytes(bytes(data))
    assert ring.read_ring(str(tmp_path), "p") == []


def test_a_value_that_is_no_int64_is_refused_by_the_ring(tmp_path: Path) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=2)
    assert not w.put_templated(frame(), 1, 1, (1, 1, None))  # type: ignore[arg-type]
    assert not w.put_templated(frame(), 2, 2, (1, 1, 2**64))
    w.close()


STEP_FIXED = {
    "kind": "step", "synced": True, "unused_parameters": [], "bucket_bytes": [64, 64, 64],
}  # fmt: skip
STEP_VARIABLES = (
    "step", "forward_start_ns", "forward_end_ns", "backward_start_ns", "backward_end_ns", "blocked_between_ns",
    "blocked_forward_ns", "blocked_backward_ns", ("bucket_ready_ns", 3), ("allreduce_start_ns", 3),
    ("allreduce_end_ns", 3), ("ready_order", 3), ("collective_seqs", 3),
)  # fmt: skip
STEP_VALUES = (5, 10, 20, 30, 90, 0, 0, 0, 40, 50, 60, 41, 51, 61, 70, 80, 0, 2, 1, 0, 11, 12, 13)
"""Bucket 2 never ended (0): it implies no end."""


def test_a_step_record_implies_its_buckets_ends_in_the_spool_and_again_when_read_from_the_ring(
    tmp_path: Path,
) -> None:
    a = spool_agent(tmp_path, "implies")
    try:
        step = RecordTemplate(STEP_FIXED, STEP_VARIABLES)
        step.implies = ("bucket_ends", "pg:3")
        assert agent.emit_templated(step, STEP_VALUES)
        from_ring = sorted(ring.read_ring(str(tmp_path), a.exporter.prefix), key=lambda r: r["seq"])
        assert a.flush_local(10.0)
        in_spool = sorted(
            (r for r in spooled(tmp_path) if r["kind"] in ("step", "collective_end")), key=lambda r: r["seq"]
        )
        assert from_ring == in_spool  # one idempotency key each: the collector stores them once
        made, *ends = in_spool
        assert made["kind"] == "step" and "\x00implies" not in made
        assert [(e["pg"], e["coll_seq"], e["end_ns"], e["time_ns"], e["ok"]) for e in ends] == [
            ("pg:3", 11, 70, 70, True), ("pg:3", 12, 80, 80, True)
        ]  # fmt: skip
        assert all((e["stream"], e["rank"], e["job"]) == (a.stream, made["rank"], made["job"]) for e in ends)
    finally:
        agent.shutdown(2.0)


def test_a_step_record_emitted_before_the_ring_exists_is_spooled_at_once_with_the_ends_it_implies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = spool_agent(tmp_path, "implies-early")
    try:
        # The state before the worker has made the spool's exporter (and with it the ring).
        monkeypatch.setattr(a, "_write_ahead_templated", None)
        step = RecordTemplate(STEP_FIXED, STEP_VARIABLES)
        step.implies = ("bucket_ends", "pg:3")
        assert agent.emit_templated(step, STEP_VALUES)  # durable: in the spool when it returns
        kinds = [r["kind"] for r in spooled(tmp_path) if r["kind"] in ("step", "collective_end")]
        assert kinds == ["step", "collective_end", "collective_end"]
    finally:
        agent.shutdown(2.0)


def test_an_implication_the_agent_does_not_know_implies_nothing(tmp_path: Path) -> None:
    a = spool_agent(tmp_path, "implies-unknown")
    try:
        step = RecordTemplate(STEP_FIXED, STEP_VARIABLES)
        step.implies = ("something_else", "pg:3")
        assert agent.emit_templated(step, STEP_VALUES)
        assert a.flush_local(10.0)
        assert [r["kind"] for r in spooled(tmp_path) if r["kind"] in ("step", "collective_end")] == ["step"]
    finally:
        agent.shutdown(2.0)
