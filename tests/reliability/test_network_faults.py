"""Network faults between the agent and the collector, injected by a TCP proxy the test controls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import Started, agent_env, finish, wait_for
from tests.support.collector_proc import CollectorProc
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

N = 2400
RATE = 150.0
PHASES: list[tuple[str, dict[str, float]]] = [
    ("pass", {}),
    ("latency", {"delay_s": 0.3}),
    ("reset", {}),
    ("hang", {}),
    ("cut", {}),
    ("lost_ack", {"after_s": 0.3}),
    ("slow", {"bytes_per_s": 4000}),
]
PHASE_S = 1.3
EMIT_BOUND_MS = 50.0


def test_network_faults_lose_nothing_duplicate_nothing_and_never_block_emit(
    tmp_path: Path, collector: CollectorProc, started: Started, figures: dict[str, Any]
) -> None:
    db = Path(collector.db_url.removeprefix("sqlite:///"))
    collector.start()
    job = "netfaults"
    with TcpProxy(collector.port, max_lifetime_s=110) as proxy:
        # A 1 s request timeout: a hung connection costs the shipper one second, then it retries.
        p = started.emitter(agent_env(proxy.url, tmp_path / "spool", job), N, RATE)
        # The shipper process may take a while to start on a loaded machine: faults begin with traffic.
        deadline = time.monotonic() + 30
        while not any(e[1] == "request" for e in proxy.events) and time.monotonic() < deadline:
            time.sleep(0.05)
        for mode, params in PHASES:
            proxy.set(mode, **params)
            # Each phase lasts until its fault really hit a request (bounded): a loaded machine may
            # leave the shipper idle or backing off for a whole short phase.
            phase_end = time.monotonic() + PHASE_S
            while time.monotonic() < phase_end or (mode != "pass" and not proxy.faults[mode]):
                if time.monotonic() > phase_end + 6 or p.poll() is not None:
                    break
                time.sleep(0.05)
        proxy.set("pass")
        summary = finish(p, 60)
        acc = wait_for(db, job, N, 45)
        faults = dict(proxy.faults)

    lost = N - acc.rows - acc.dropped_steps
    figures["network_faults"] = {
        "modes": [m for m, _ in PHASES if m != "pass"],
        "faults_injected": faults,
        "step_records_emitted": N,
        "step_records_delivered": acc.rows,
        "step_records_lost": lost,
        "duplicates": acc.duplicates,
        "max_emit_ms": round(summary["max_emit_ms"], 3),
        "p99_emit_ms": round(summary["p99_emit_ms"], 4),
    }
    # Every fault really happened to some request (a mode with no traffic would prove nothing).
    for mode in ("latency", "reset", "hang", "cut", "lost_ack", "slow"):
        assert faults.get(mode, 0) > 0, f"no {mode} fault was injected: {faults}"
    assert (acc.rows, acc.duplicates, acc.dropped_steps, lost) == (N, 0, 0, 0), acc.dropped
    assert acc.per_rank == {0: set(range(N))}
    # emit() only appends to a deque: network trouble never reaches the training thread.
    assert summary["max_emit_ms"] < EMIT_BOUND_MS, summary
