"""The write-ahead ring and the agent's rationed wake-ups: what makes a durable record cheap and an
idle or busy agent quiet, without losing the crash durability and the fast path of urgent records."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from ddpscope import agent
from ddpscope.agent import _core, ring
from ddpscope.agent.spool_exporter import SpoolExporter
from tests.agent.conftest import spooled
from tests.agent.fake_collector import FakeCollector
from tests.support.procs import pid_alive


def collective(seq: int, call_site: str = "train.py:7") -> dict[str, Any]:
    return {
        "kind": "collective", "job": "j", "rank": 0, "stream": "s", "seq": seq, "time_ns": seq,
        "pg": "default", "coll_seq": seq, "op": "all_reduce", "reduce_op": "SUM", "shapes": [[16]],
        "dtypes": ["float32"], "call_site": call_site, "start_ns": seq, "step": None, "source": "user",
    }  # fmt: skip


def heartbeat(step: int) -> dict[str, Any]:
    return {
        "kind": "heartbeat", "job": "j", "rank": 0, "stream": "s", "seq": step, "time_ns": step,
        "phase": "forward", "step": step, "last_coll_seq": 0, "pid": os.getpid(),
    }  # fmt: skip


def voluntary_switches(native_id: int | None) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        line = next(ln for ln in f if ln.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def test_the_ring_keeps_the_latest_records_after_wrapping_around(tmp_path: Path) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=8)
    for seq in range(1, 21):
        assert w.put(collective(seq))
    got = sorted(r["seq"] for r in ring.read_ring(str(tmp_path), "p"))
    w.close()
    assert got == list(range(13, 21))


def test_a_longer_record_overwritten_by_a_shorter_one_leaves_no_ghost(tmp_path: Path) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=1)
    assert w.put(collective(1, call_site="x" * 500))
    assert w.put(collective(2))
    w.close()
    assert [r["seq"] for r in ring.read_ring(str(tmp_path), "p")] == [2]


def test_a_torn_slot_is_skipped_and_the_others_still_read(tmp_path: Path) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p", slots=4)
    for seq in range(1, 5):
        w.put(collective(seq))
    w.close()
    path = Path(ring.ring_path(str(tmp_path), "p"))
    data = bytearray(path.read_bytes())
    data[ring.SLOT_BYTES + 40] ^= 0xFF  # inside slot 1's payload: its crc no longer holds
    path.write_bytes(bytes(data))
    assert sorted(r["seq"] for r in ring.read_ring(str(tmp_path), "p")) == [1, 3, 4]


def test_a_record_too_big_for_a_slot_is_refused_and_emit_durable_spools_it_at_once(tmp_path: Path) -> None:
    w = ring.WriteAheadRing(str(tmp_path), "p")
    assert not w.put(collective(1, call_site="x" * ring.SLOT_BYTES))
    w.close()
    # Port 9 refuses connections: the spool keeps what was written for us to read.
    a = agent.configure(
        job="big", rank=0, url="http://127.0.0.1:9", spool_dir=str(tmp_path), flush_interval_s=60
    )
    try:
        assert a.flush_local(30.0)  # the exporter and its ring exist
        big = {k: v for k, v in collective(1, call_site="x" * ring.SLOT_BYTES).items() if k not in _ENVELOPE}
        assert _core.emit_durable(big)
        assert [r["coll_seq"] for r in spooled(tmp_path) if r["kind"] == "collective"] == [1]
    finally:
        agent.shutdown(2.0)


_ENVELOPE = ("job", "rank", "stream", "seq", "time_ns")


def test_emit_durable_does_not_drain_an_in_memory_exporter_in_the_callers_thread() -> None:
    # Records kept in memory die with the process whenever they are exported: draining the queue in
    # the training thread before a collective would cost it time and protect nothing.
    exporter = agent.InMemoryExporter()
    a = agent.configure(job="mem", rank=0, exporter=exporter, flush_interval_s=60)
    try:
        assert a.flush_local(10.0)
        exporter.clear()
        record = {k: v for k, v in collective(3).items() if k not in _ENVELOPE}
        assert agent.emit_durable(record)
        assert exporter.records == []
        assert a.flush_local(10.0)
        assert [r["coll_seq"] for r in exporter.records if r["kind"] == "collective"] == [3]
    finally:
        agent.shutdown(2.0)


def test_emit_durable_goes_to_the_ring_not_the_spool_and_keeps_one_key_for_both(tmp_path: Path) -> None:
    a = agent.configure(
        job="k", rank=0, url="http://127.0.0.1:9", spool_dir=str(tmp_path), flush_interval_s=60
    )
    try:
        assert a.flush_local(30.0)
        record = {k: v for k, v in collective(5).items() if k not in _ENVELOPE}
        assert _core.emit_durable(record)
        assert not [r for r in spooled(tmp_path) if r["kind"] == "collective"], "no spool write yet"
        prefix = a.exporter.prefix
        (in_ring,) = ring.read_ring(str(tmp_path), prefix)
        assert a.flush_local(10.0)
        (in_spool,) = [r for r in spooled(tmp_path) if r["kind"] == "collective"]
        assert in_ring == in_spool and in_ring["stream"] == a.stream
        assert "seq" not in record, "the caller's dict is not modified"
    finally:
        agent.shutdown(2.0)


def test_an_idle_agent_thread_sleeps_instead_of_waking_fifty_times_a_second() -> None:
    exporter = agent.InMemoryExporter()
    a = agent.configure(job="idle", rank=0, exporter=exporter, flush_interval_s=0.02)
    worker = a._worker
    assert worker._thread is not None
    deadline = time.monotonic() + 10
    while not worker.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.idle
    before = voluntary_switches(worker._thread.native_id)
    time.sleep(1.5)
    woke = voluntary_switches(worker._thread.native_id) - before
    assert woke <= 6, f"{woke} wake-ups in 1.5 s (a 20 ms poll makes 75)"
    # The next record ends the idle sleep at once rather than waiting up to a second.
    agent.emit({"kind": "rank_exit", "step": 1, "reason": "finished"})
    assert not worker.idle
    deadline = time.monotonic() + 10
    while not exporter.records and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [r["kind"] for r in exporter.records] == ["rank_exit"]


def test_the_shipper_is_woken_once_per_interval_but_at_once_for_a_hang(tmp_path: Path) -> None:
    with FakeCollector() as collector:
        exporter = SpoolExporter(
            spool_dir=str(tmp_path),
            prefix="r0-s",
            meta={"job": "j", "rank": 0, "stream": "s"},
            ingest_url=collector.url + "/api/v1/ingest",
            crash_file=False,
            ship_interval_s=60.0,
        )
        try:
            exporter.export([heartbeat(0)])  # the first export wakes the shipper
            assert collector.wait_for(lambda c: len(c.of_kind("heartbeat")) == 1, 20)
            exporter.export([heartbeat(1)])  # within the interval: no wake-up, it waits on disk
            time.sleep(1.0)
            assert len(collector.of_kind("heartbeat")) == 1
            hang = {**heartbeat(2), "kind": "hang_resolved", "step": 2, "hang_s": 1.0}
            del hang["phase"], hang["last_coll_seq"], hang["pid"]
            exporter.export([hang])
            assert collector.wait_for(
                lambda c: c.of_kind("hang_resolved") and len(c.of_kind("heartbeat")) == 2, 20
            )
        finally:
            exporter.shutdown(1.0)
            pid = exporter.shipper_pid
            if pid is not None:
                deadline = time.monotonic() + 10
                while pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)


def test_the_shipper_runs_at_a_lower_priority_than_its_rank(tmp_path: Path) -> None:
    a = agent.configure(job="nice", rank=0, url="http://127.0.0.1:9", spool_dir=str(tmp_path))
    try:
        assert a.flush_local(30.0)
        pid = a.exporter.shipper_pid
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0):
            assert time.monotonic() < deadline, "the shipper never lowered its priority"
            time.sleep(0.02)
        assert os.getpriority(os.PRIO_PROCESS, pid) > os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        agent.shutdown(2.0)
        assert threading.main_thread().is_alive()
