"""emit() and the agent object: never raises, bounded, counts its drops, urgent fast path, disabled."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ddpscope import agent
from ddpscope.agent import InMemoryExporter, _core
from ddpscope.agent.records import validate_record


def heartbeat(i: int) -> dict[str, object]:
    return {"kind": "heartbeat", "phase": "idle", "step": i, "last_coll_seq": 0, "pid": os.getpid()}


def test_emit_never_raises_and_reports_what_it_swallowed(agent_errors_fail_the_test) -> None:
    exp = InMemoryExporter()
    a = agent.configure(job="j", rank=0, exporter=exp)
    for junk in (None, [1, 2], {"no": "kind"}, {"kind": "step"}, {"kind": "heartbeat", "step": "three"}):
        agent.emit(junk)  # type: ignore[arg-type]
    agent.emit(heartbeat(1))
    assert a.force_flush(5.0)
    assert [r["step"] for r in exp.records if r["kind"] == "heartbeat"] == [1]
    assert a.stats()["emitted"] == 6
    assert sum(a.stats()["dropped"].values()) == 5
    assert len(agent_errors_fail_the_test) >= 5  # each one was reported, not silently lost
    agent_errors_fail_the_test.clear()


def test_the_agent_never_mutates_the_callers_record() -> None:
    exp = InMemoryExporter()
    a = agent.configure(job="j", rank=0, exporter=exp)
    record = heartbeat(4)
    before = dict(record)
    agent.emit(record)
    assert a.force_flush(5.0)
    assert record == before
    assert exp.records[0]["seq"] == 0


def test_a_full_queue_drops_new_records_and_counts_them_by_reason_and_kind() -> None:
    exp = InMemoryExporter()
    # A flush interval of a minute: the worker does not drain during the burst.
    a = agent.configure(job="j", rank=0, exporter=exp, max_queue=100, flush_interval_s=60.0)
    for i in range(250):
        agent.emit(heartbeat(i))
    assert a.force_flush(5.0)
    delivered = [r for r in exp.records if r["kind"] == "heartbeat"]
    assert [r["step"] for r in delivered] == list(range(100))  # the oldest are kept
    (stats,) = [r for r in exp.records if r["kind"] == "agent_stats"]
    validate_record(stats)
    assert stats["emitted"] == 250 and stats["dropped"] == {"queue_full:heartbeat": 150}


def test_agent_stats_are_cumulative_and_sent_when_they_change() -> None:
    exp = InMemoryExporter()
    a = agent.configure(job="j", rank=0, exporter=exp)
    agent.emit(heartbeat(0))
    assert a.force_flush(5.0)
    assert a.force_flush(5.0)  # nothing changed: no new stats record
    agent.emit(heartbeat(1))
    assert a.force_flush(5.0)
    stats = [r for r in exp.records if r["kind"] == "agent_stats"]
    assert [s["emitted"] for s in stats] == [1, 2]


def test_urgent_records_are_printed_as_one_line_on_stderr(capfd) -> None:
    a = agent.configure(job="j", rank=2, exporter=InMemoryExporter())
    agent.emit(
        {
            "kind": "rank_error",
            "step": 9,
            "phase": "backward",
            "error_type": "RuntimeError",
            "message": "Connection reset by peer\nmore",
            "stack": "...",
            "fatal": False,
        }
    )
    assert a.force_flush(5.0)
    err = capfd.readouterr().err
    assert "ddpscope: rank_error rank=2 step=9: Connection reset by peer\n" in err


def test_configure_replaces_the_agent_and_flushes_the_old_one() -> None:
    first, second = InMemoryExporter(), InMemoryExporter()
    a1 = agent.configure(job="j", rank=0, exporter=first, flush_interval_s=60.0)
    agent.emit(heartbeat(1))
    a2 = agent.configure(job="j", rank=0, exporter=second)
    agent.emit(heartbeat(2))
    assert a2.force_flush(5.0)
    assert a1 is not a2 and a1.stream != a2.stream
    assert [r["step"] for r in first.records if r["kind"] == "heartbeat"] == [1]
    assert [r["step"] for r in second.records if r["kind"] == "heartbeat"] == [2]
    assert agent.get_agent() is a2


def test_many_threads_emitting_at_once_lose_nothing_and_share_one_gapless_sequence() -> None:
    exp = InMemoryExporter()
    a = agent.configure(job="j", rank=0, exporter=exp)
    threads = [
        threading.Thread(target=lambda: [agent.emit(heartbeat(i)) for i in range(2000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.force_flush(10.0)
    beats = [r for r in exp.records if r["kind"] == "heartbeat"]
    assert sorted(r["seq"] for r in beats) == list(range(8000))


def test_disabled_means_no_threads_no_files_and_no_hooks(monkeypatch, tmp_path: Path) -> None:
    import signal
    import sys

    monkeypatch.setenv("DDPSCOPE_DISABLED", "1")
    monkeypatch.setenv("DDPSCOPE_SPOOL_DIR", str(tmp_path / "spool"))
    _core._agent = None
    threads_before = threading.active_count()
    handler_before, hook_before = signal.getsignal(signal.SIGTERM), sys.excepthook
    a = agent.get_agent()
    agent.emit(heartbeat(1))
    assert isinstance(a, _core.NullAgent) and a.force_flush(1.0)
    assert a.config.disabled and a.config.heartbeat_s == 2.0
    assert threading.active_count() == threads_before
    assert not (tmp_path / "spool").exists()
    assert signal.getsignal(signal.SIGTERM) is handler_before and sys.excepthook is hook_before


def test_shutdown_then_emit_counts_the_late_record_instead_of_raising() -> None:
    a = agent.configure(job="j", rank=0, exporter=InMemoryExporter())
    agent.shutdown(2.0)
    agent.emit(heartbeat(1))
    assert a.stats()["dropped"] == {"after_shutdown:heartbeat": 1}


@pytest.mark.parametrize("kind", ["hang", "hang_resolved", "rank_error"])
def test_every_urgent_kind_wakes_the_worker_at_once(kind: str) -> None:
    from ddpscope.agent.records import URGENT_KINDS

    assert kind in URGENT_KINDS
    exp = InMemoryExporter()
    agent.configure(job="j", rank=0, exporter=exp, flush_interval_s=60.0)
    record = {
        "hang": {
            "kind": "hang",
            "phase": "allreduce",
            "step": 1,
            "stalled_s": 300.0,
            "pending_buckets": [],
            "inflight": [],
            "stacks": [],
            "message": "no progress",
        },
        "hang_resolved": {"kind": "hang_resolved", "step": 1, "hang_s": 3.0},
        "rank_error": {
            "kind": "rank_error",
            "step": 1,
            "phase": "forward",
            "error_type": "E",
            "message": "m",
            "stack": "s",
            "fatal": False,
        },
    }[kind]
    agent.emit(record)
    import time

    deadline = time.monotonic() + 10
    while not exp.records and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [r["kind"] for r in exp.records] == [kind]
