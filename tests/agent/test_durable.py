"""``make_durable``: what was emitted is in the on-disk spool when it returns, without waiting for
the worker's round (which these tests push 10 s away), and a cheap no-op when nothing is queued."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpscope import agent
from tests.agent.conftest import kill_shippers, spooled


@pytest.fixture
def spool_dir(tmp_path: Path) -> Iterator[Path]:
    # Port 9 (discard) refuses connections: the shipper keeps everything on disk for us to read.
    agent.configure(
        job="durable", rank=0, url="http://127.0.0.1:9", spool_dir=str(tmp_path), flush_interval_s=10
    )
    try:
        yield tmp_path
    finally:
        agent.shutdown(2.0)
        kill_shippers(tmp_path)


def record(seq: int) -> dict[str, Any]:
    return {
        "kind": "collective", "pg": "default", "coll_seq": seq, "op": "all_reduce", "reduce_op": "SUM",
        "shapes": [[16]], "dtypes": ["float32"], "call_site": "train.py:7", "start_ns": 1, "step": None,
        "source": "user",
    }  # fmt: skip


def test_a_record_followed_by_make_durable_is_in_the_spool_before_the_worker_wakes(spool_dir: Path) -> None:
    agent.emit(record(1))
    assert agent.make_durable(timeout_s=10.0)  # generous: the first call waits for the shipper to start
    agent.emit(record(2))
    agent.emit(record(3))
    assert agent.make_durable()
    assert [r["coll_seq"] for r in spooled(spool_dir) if r["kind"] == "collective"] == [1, 2, 3]


def test_without_make_durable_a_record_waits_in_memory_for_the_worker_round(spool_dir: Path) -> None:
    agent.emit(record(1))
    assert agent.make_durable(timeout_s=10.0)
    agent.emit(record(2))
    # The worker sleeps 10 s between rounds here: record 2 is still only in this process's memory,
    # which is what an abort right now would lose.
    assert [r["coll_seq"] for r in spooled(spool_dir) if r["kind"] == "collective"] == [1]


def test_make_durable_adds_no_records_of_its_own(spool_dir: Path) -> None:
    agent.emit(record(1))
    assert agent.make_durable(timeout_s=10.0)
    for _ in range(50):
        assert agent.make_durable()  # nothing queued: returns without touching the spool
    assert [r["kind"] for r in spooled(spool_dir)] == ["collective"]


def test_make_durable_is_true_and_free_when_the_agent_is_disabled(tmp_path: Path) -> None:
    agent.configure(disabled=True)
    agent.emit(record(1))
    assert agent.make_durable()
    assert not list(tmp_path.iterdir())
