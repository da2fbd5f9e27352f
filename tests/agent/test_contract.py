"""One contract, every exporter: in-memory, direct HTTP, and spool + shipper process."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddpscope import agent
from ddpscope.agent import ExportResult, InMemoryExporter
from ddpscope.agent.spool_exporter import SpoolExporter
from ddpscope.agent.transport import HttpExporter
from tests.agent.fake_collector import FakeCollector


@dataclass
class Sink:
    exporter: Any
    delivered: Callable[[], list[dict[str, Any]]]


@pytest.fixture(params=["in-memory", "http", "spool"])
def sink(request: pytest.FixtureRequest, collector: FakeCollector, spool_dir: Path) -> Iterator[Sink]:
    def from_collector() -> list[dict[str, Any]]:
        return [r for r in collector.records.values() if r["kind"] != "agent_stats"]

    if request.param == "in-memory":
        mem = InMemoryExporter()
        yield Sink(mem, lambda: [r for r in mem.records if r["kind"] != "agent_stats"])
    elif request.param == "http":
        yield Sink(HttpExporter(collector.url + "/api/v1/ingest", timeout_s=2.0), from_collector)
    else:
        meta = {"job": "contract", "rank": 0, "stream": "s"}
        exporter = SpoolExporter(
            spool_dir=str(spool_dir), prefix="r0-s", meta=meta, ingest_url=collector.url + "/api/v1/ingest"
        )
        yield Sink(exporter, from_collector)
        exporter.shutdown(1.0)


def records(n: int, stream: str = "s") -> list[dict[str, Any]]:
    return [
        {
            "kind": "rank_exit",
            "job": "contract",
            "rank": 0,
            "stream": stream,
            "seq": i,
            "time_ns": i,
            "step": i,
            "reason": "finished",
        }
        for i in range(n)
    ]


def test_every_exported_record_is_delivered_once_after_force_flush(sink: Sink) -> None:
    for i in range(0, 300, 100):
        assert sink.exporter.export(records(300)[i : i + 100]) is ExportResult.SUCCESS
    assert sink.exporter.force_flush(10.0)
    got = sink.delivered()
    assert sorted(r["seq"] for r in got) == list(range(300))


def test_records_emitted_through_the_agent_carry_the_envelope_and_a_gapless_sequence(sink: Sink) -> None:
    a = agent.configure(job="contract", rank=3, exporter=sink.exporter)
    for i in range(250):
        agent.emit(
            {"kind": "heartbeat", "phase": "forward", "step": i, "last_coll_seq": i, "pid": os.getpid()}
        )
    assert a.force_flush(10.0)
    got = sorted(sink.delivered(), key=lambda r: r["seq"])
    assert [r["seq"] for r in got] == list(range(250))
    assert [r["step"] for r in got] == list(range(250))  # seq follows emit order
    assert {(r["job"], r["rank"], r["stream"]) for r in got} == {("contract", 3, a.stream)}
    assert all(isinstance(r["time_ns"], int) and r["time_ns"] > 0 for r in got)


def test_an_urgent_record_is_delivered_without_a_flush(sink: Sink) -> None:
    # A flush interval of a minute: only the urgent fast path can deliver within the wait below.
    agent.configure(job="contract", rank=0, exporter=sink.exporter, flush_interval_s=60.0)
    agent.emit({"kind": "hang_resolved", "step": 7, "hang_s": 1.5})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not sink.delivered():
        time.sleep(0.01)  # for the spool, the shipper is woken by the write itself
    assert [r["kind"] for r in sink.delivered()] == ["hang_resolved"]


def test_export_after_shutdown_is_refused(sink: Sink) -> None:
    sink.exporter.shutdown(1.0)
    assert sink.exporter.export(records(1)) is not ExportResult.SUCCESS
