"""A collector that fails in every way HTTP allows: the records still arrive exactly once."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ddpscope import agent
from ddpscope.agent.records import STEP_ARRAYS
from ddpscope.agent.transport import (
    HttpExporter,
    batch_body,
    encode_record,
    encode_records,
    is_gzip,
    parse_retry_after,
)
from tests.agent.fake_collector import FakeCollector

FAULTS = [500, ("429", 0.1), "reset", "hang", "commit-then-500", ("503", 0), 502, "reset"]


def heartbeat(i: int) -> dict[str, object]:
    return {"kind": "heartbeat", "phase": "backward", "step": i, "last_coll_seq": i, "pid": os.getpid()}


def configure(pipeline: str, collector: FakeCollector, spool_dir: Path, **kw: object) -> agent.Agent:
    common = dict(
        job="faults",
        rank=0,
        url=collector.url,
        spool_dir=str(spool_dir),
        http_timeout_s=0.5,
        retry_max_backoff_s=0.2,
    )
    if pipeline == "http":
        exporter = HttpExporter(
            collector.url + "/api/v1/ingest",
            timeout_s=0.5,
            retry_max_backoff_s=0.2,
            rejected_path=str(spool_dir / "rejected.jsonl"),
        )
        return agent.configure(**common, exporter=exporter, **kw)
    return agent.configure(**common, **kw)


@pytest.mark.parametrize("pipeline", ["spool", "http"])
def test_every_record_arrives_exactly_once_through_a_flaky_collector(pipeline, collector, spool_dir) -> None:
    collector.hang_s = 2.0
    collector.script(*FAULTS)
    a = configure(pipeline, collector, spool_dir)
    for i in range(2000):
        agent.emit(heartbeat(i))
        if i % 500 == 499:
            assert a.force_flush(20.0)
    assert sorted(r["step"] for r in collector.of_kind("heartbeat")) == list(range(2000))
    assert collector.requests[: len(FAULTS)] == FAULTS, "every fault was served"
    assert collector.duplicates >= 1, "commit-then-500 forces a resend, which the key deduplicates"


def test_retry_after_is_honoured_before_the_next_attempt(collector, spool_dir) -> None:
    collector.script(("429", 1))
    a = configure("spool", collector, spool_dir)
    agent.emit(heartbeat(0))
    assert a.force_flush(10.0)
    assert len(collector.request_times) >= 2
    assert collector.request_times[1] - collector.request_times[0] >= 0.9


def test_a_batch_the_collector_did_not_take_is_posted_again_as_it_was(collector, spool_dir) -> None:
    """Retries resend the bytes of the first try, not a batch read and encoded again from the spool,
    which has grown meanwhile: an outage costs the shipper one encoding, not one per try."""
    collector.script(("429", 1), 503, "reset")
    a = configure("spool", collector, spool_dir)
    agent.emit(heartbeat(0))
    assert a.flush_local(5.0)
    assert collector.wait_for(lambda c: len(c.requests) >= 1, timeout_s=10)
    for i in range(1, 200):  # into the spool while the shipper waits out the Retry-After
        agent.emit(heartbeat(i))
    assert a.flush_local(5.0)
    assert a.force_flush(20.0)
    assert collector.requests[:4] == [("429", 1), 503, "reset", "ok"]
    assert len(set(collector.bodies[:4])) == 1, "the batch was posted again byte for byte"
    assert len(collector.bodies) > 4, "the records spooled during the outage came in a later batch"
    assert sorted(r["step"] for r in collector.of_kind("heartbeat")) == list(range(200))


def test_retry_after_accepts_seconds_and_http_dates_and_is_capped() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: retry now
    assert parse_retry_after("86400") == 60.0
    assert parse_retry_after("soon") is None


@pytest.mark.parametrize("pipeline", ["spool", "http"])
def test_a_refused_batch_is_set_aside_and_counted_and_never_retried(pipeline, collector, spool_dir) -> None:
    collector.script(400)
    a = configure(pipeline, collector, spool_dir)
    for i in range(5):
        agent.emit(heartbeat(i))
    a.force_flush(10.0)
    for i in range(5, 8):
        agent.emit(heartbeat(i))
    assert a.force_flush(10.0)
    assert collector.requests.count(400) == 1
    assert sorted(r["step"] for r in collector.of_kind("heartbeat")) == [5, 6, 7]
    assert collector.dropped_total() == 5
    (rejected,) = [p for p in spool_dir.iterdir() if "rejected" in p.name]
    lines = rejected.read_text().splitlines()
    assert json.loads(lines[0][1:])["rejected_status"] == 400
    assert sorted(json.loads(x)["step"] for x in lines[1:] if json.loads(x)["kind"] == "heartbeat") == list(
        range(5)
    )


@pytest.mark.parametrize("pipeline", ["spool", "http"])
def test_a_collector_older_than_the_agent_gets_every_record_but_the_kinds_it_does_not_know(
    pipeline, collector, spool_dir
) -> None:
    collector.unknown_kinds = {"replica_digest"}
    a = configure(pipeline, collector, spool_dir)
    for i in range(6):
        agent.emit(heartbeat(i))
        if i % 2 == 0:
            agent.emit({"kind": "replica_digest", "step": i, "syncs": i, "model": 0, "parameters": 1, "group": 1,
                        "norms": [1.5]})  # fmt: skip
        if i == 2:
            assert a.force_flush(10.0)
    assert a.force_flush(10.0)
    assert sorted(r["step"] for r in collector.of_kind("heartbeat")) == list(range(6))
    assert collector.of_kind("replica_digest") == []
    assert collector.dropped_total() == 3  # the three digests, counted in the agent's stats
    assert collector.unknown_refusals == 1  # learnt once, then left out of every batch


def test_a_refusal_of_a_kind_this_agent_does_not_have_is_a_real_refusal() -> None:
    from ddpscope.agent.transport import OlderCollector, Outcome

    older = OlderCollector("http://collector")
    bogus = Outcome(False, False, 422, None, "Invalid value 'bogus' - at `batch.records[0].kind`")
    assert not older.learn(bogus) and not older.kinds
    digest = Outcome(False, False, 422, None, "Invalid value 'replica_digest' - at `batch.records[7].kind`")
    assert older.learn(digest) and older.kinds == {"replica_digest"}
    assert not older.learn(digest)  # already left out: refused again means something else


def test_the_token_is_sent_as_a_bearer_header(spool_dir) -> None:
    with FakeCollector(token="s3cret") as collector:
        a = configure("spool", collector, spool_dir, token="s3cret")
        agent.emit(heartbeat(1))
        assert a.force_flush(10.0)
        assert [r["step"] for r in collector.of_kind("heartbeat")] == [1]


def test_a_collector_restart_loses_nothing(collector, spool_dir) -> None:
    a = configure("spool", collector, spool_dir)
    agent.emit(heartbeat(0))
    assert a.force_flush(10.0)
    collector.stop()
    for i in range(1, 100):
        agent.emit(heartbeat(i))
    assert not a.force_flush(0.5), "nothing can be acknowledged while the collector is down"
    collector.start()
    assert a.force_flush(15.0)
    assert sorted(r["step"] for r in collector.of_kind("heartbeat")) == list(range(100))


@pytest.mark.parametrize("pipeline", ["spool", "http"])
def test_values_of_builtin_subclasses_and_one_element_tensors_arrive_as_plain_values(
    pipeline, collector, spool_dir
) -> None:
    """marshal (the spool's codec) refuses subclasses of str and int: ``torch.__version__`` is one,
    and every rank_start carried it until this was caught."""
    import enum

    import torch

    class Phase(enum.IntEnum):
        BACKWARD = 3

    a = configure(pipeline, collector, spool_dir)
    agent.emit(
        {
            "kind": "rank_exit",
            "step": Phase.BACKWARD,
            "reason": "finished",
            "torch_version": torch.__version__,
            "samples": torch.tensor(7),
            "loss": torch.tensor([0.5]),
            "tags": ("a", "b"),
        }
    )
    assert a.force_flush(10.0)
    [got] = collector.of_kind("rank_exit")
    assert got["step"] == 3 and got["samples"] == 7 and got["loss"] == 0.5
    assert got["torch_version"] == str(torch.__version__) and got["tags"] == ["a", "b"]


def test_a_record_json_cannot_carry_is_counted_and_the_rest_of_its_batch_arrives(
    collector, spool_dir
) -> None:
    a = configure("spool", collector, spool_dir)
    agent.emit({"kind": "hang_resolved", "step": 1, "hang_s": float("nan")})
    agent.emit(heartbeat(2))
    assert a.force_flush(10.0)
    assert [r["step"] for r in collector.of_kind("heartbeat")] == [2]
    assert collector.of_kind("hang_resolved") == []
    assert collector.wait_for(
        lambda c: any(
            r["dropped"].get("unserializable:hang_resolved") == 1 for r in c.of_kind("agent_stats")
        ),
        10,
    )


def _read(body: bytes) -> Any:
    return json.loads(gzip.decompress(body) if is_gzip(body) else body)


def test_records_encoded_in_one_call_read_as_if_encoded_one_by_one() -> None:
    """``encode_records`` (the shipper's one encoder call per chunk) leaves out exactly the records
    ``encode_record`` refuses, a NaN or a cycle anywhere in the list, and keeps the rest in order."""
    cycle: list[object] = [1]
    cycle.append(cycle)
    step = {
        "kind": "step",
        "step": 3,
        **{name: [5, 9] for name in STEP_ARRAYS},
    }
    good = [heartbeat(1), step, heartbeat(2)]
    bad = [{"kind": "hang_resolved", "hang_s": float("nan")}, {"kind": "x", "v": cycle}]
    records = [good[0], bad[0], good[1], bad[1], good[2]]
    for batch in (good, records):
        items, shipped = encode_records(batch)
        assert shipped == good
        body = _read(batch_body([items, encode_record(heartbeat(9))]))
        assert body["records"] == [json.loads(encode_record(r)) for r in [*good, heartbeat(9)]]
    assert encode_records([]) == (b"", [])
    assert _read(batch_body([b"", encode_record(heartbeat(9))]))["records"] == [heartbeat(9)]
