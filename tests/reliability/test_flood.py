"""A flood from one job: the collector sheds load with 429 + Retry-After and stays up; a real agent
caught in it waits as told and loses nothing."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import Started, agent_env, finish, wait_for
from tests.support.collector_proc import CollectorProc
from tests.support.synth import batch, synth_job
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FLOOD_THREADS = 48
FLOOD_S = 6.0
N = 800


def flood(port: int, stop: threading.Event, statuses: Counter[str], lock: threading.Lock, tid: int) -> None:
    # One body per thread; a fresh stream name per request makes every record a real insert.
    template = json.dumps(batch(synth_job(1, 12, 4, job="flooder", finished=False))).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    i = 0
    while not stop.is_set():
        body = template.replace(b'"flooder-r0"', f'"t{tid}-{i}"'.encode())
        i += 1
        try:
            conn.request("POST", "/api/v1/ingest", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            key = str(resp.status)
            if resp.status == 429:
                key += " with Retry-After" if resp.getheader("Retry-After") else " without Retry-After"
        except (OSError, http.client.HTTPException) as e:
            key = type(e).__name__
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        with lock:
            statuses[key] += 1
    conn.close()


def test_a_flood_gets_429_with_retry_after_and_the_agent_in_it_waits_and_loses_nothing(
    tmp_path: Path, collector: CollectorProc, started: Started, figures: dict[str, Any]
) -> None:
    db = Path(collector.db_url.removeprefix("sqlite:///"))
    collector.start()
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    threads = [
        threading.Thread(target=flood, args=(collector.port, stop, statuses, lock, t), daemon=True)
        for t in range(FLOOD_THREADS)
    ]
    with TcpProxy(collector.port, max_lifetime_s=140) as proxy:
        env = agent_env(proxy.url, tmp_path / "spool", "flood-victim", DDPSCOPE_HTTP_TIMEOUT_S="10")
        for t in threads:
            t.start()
        p = started.emitter(env, N, N / (FLOOD_S - 1))
        alive_during = []
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
            alive_during.append(collector.proc is not None and collector.proc.poll() is None)
        stop.set()
        for t in threads:
            t.join(30)
        summary = finish(p, 60)
        acc = wait_for(db, "flood-victim", N, 60)
        events = list(proxy.events)
    healthy_after = collector.healthy()

    # Each 429 the agent got, and how long it waited before its next request.
    waits: list[float] = []
    for i, (at, what, value) in enumerate(events):
        if what == "status" and value == 429:
            nxt = next((e[0] for e in events[i + 1 :] if e[1] == "request"), None)
            if nxt is not None:
                waits.append(nxt - at)
    figures["flood"] = {
        "flood_threads": FLOOD_THREADS,
        "flood_requests": sum(statuses.values()),
        "flood_statuses": dict(statuses),
        "collector_alive_throughout": all(alive_during) and healthy_after,
        "agent_429s": len(waits),
        "agent_min_wait_after_429_s": round(min(waits), 3) if waits else None,
        "step_records_emitted": N,
        "step_records_delivered": acc.rows,
        "step_records_lost": N - acc.rows - acc.dropped_steps,
        "duplicates": acc.duplicates,
        "max_emit_ms": round(summary["max_emit_ms"], 3),
    }
    assert all(alive_during) and healthy_after, collector.log_tail()
    assert statuses["429 with Retry-After"] > 0, statuses
    assert statuses["429 without Retry-After"] == 0
    assert not any(k.startswith("5") for k in statuses), statuses
    assert waits, f"the agent never met a 429 (flood too weak?): {statuses}"
    # Retry-After: 1 -> the agent's next attempt comes no sooner (allow 10% for timer slack).
    assert min(waits) >= 0.9, waits
    assert (acc.rows, acc.duplicates, acc.dropped_steps) == (N, 0, 0), dict(acc.dropped)
