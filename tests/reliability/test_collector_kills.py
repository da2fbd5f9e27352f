"""The collector SIGKILLed again and again under load, restarted on the same SQLite file."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import GLOO_JOB, Started, agent_env, finish, integrity_ok, wait_for
from tests.support.collector_proc import CollectorProc
from tests.support.procs import describe, exited_cleanly, started_ranks, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KILLS = 10
PER_RANK = 4000
RATE = 100.0
GLOO_STEPS = 30


def test_ten_collector_sigkills_lose_and_duplicate_no_step_record(
    tmp_path: Path, collector: CollectorProc, started: Started, figures: dict[str, Any]
) -> None:
    db = Path(collector.db_url.removeprefix("sqlite:///"))
    url = collector.start()
    synth_job, real_job = "kills-synthetic", "kills-gloo"
    emitters = [
        started.emitter(agent_env(url, tmp_path / "spool", synth_job, rank=r), PER_RANK, RATE) for r in (0, 1)
    ]
    gloo_env = agent_env(url, tmp_path / "spool-gloo", real_job)
    del gloo_env["RANK"]  # set per rank by started_ranks
    started.spool_dirs.append(tmp_path / "spool-gloo")
    rng = random.Random(10)
    checks: list[str] = []
    downtime = 0.0
    with started_ranks(GLOO_JOB, 2, args=[str(GLOO_STEPS), "0.8"], env=gloo_env) as ranks:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 0.7))  # a random moment: mid-request, mid-commit, idle
            down_at = time.monotonic()
            collector.kill()
            checks.append(integrity_ok(db))
            time.sleep(rng.uniform(0.0, 0.4))
            collector.start()
            downtime += time.monotonic() - down_at
        results = wait_all(ranks, 120)
    assert all(exited_cleanly(r) for r in results), describe(results, tail=2000)
    summaries = [finish(p, 60) for p in emitters]

    synth = wait_for(db, synth_job, 2 * PER_RANK, 60)
    real = wait_for(db, real_job, 2 * GLOO_STEPS, 30)
    collector.kill()
    final_check = integrity_ok(db)

    emitted = sum(s["emitted"] for s in summaries)
    lost = emitted - synth.rows - synth.dropped_steps
    real_lost = 2 * GLOO_STEPS - real.rows
    figures["collector_sigkill"] = {
        "kills": collector.kills - 1,
        "restarts": collector.starts - 1,
        "collector_down_s": round(downtime, 1),
        "step_records_emitted": emitted + 2 * GLOO_STEPS,
        "step_records_delivered": synth.rows + real.rows,
        "step_records_dropped_counted": synth.dropped_steps + real.dropped_steps,
        "step_records_lost": lost + real_lost,
        "duplicates": synth.duplicates + real.duplicates,
        "integrity_checks_ok": sum(c == "ok" for c in [*checks, final_check]),
    }
    assert checks == ["ok"] * KILLS and final_check == "ok"
    assert collector.kills - 1 == KILLS
    assert synth.dropped_steps == 0 and real.dropped_steps == 0, (synth.dropped, real.dropped)
    assert (synth.rows, synth.duplicates, lost) == (emitted, 0, 0)
    assert {r: len(s) for r, s in synth.per_rank.items()} == {0: PER_RANK, 1: PER_RANK}
    assert (real.rows, real.duplicates) == (2 * GLOO_STEPS, 0)
    assert real.per_rank == {0: set(range(GLOO_STEPS)), 1: set(range(GLOO_STEPS))}


def test_a_live_job_is_not_called_silent_while_its_backlog_arrives_after_a_long_collector_outage(
    tmp_path: Path, collector: CollectorProc, started: Started
) -> None:
    import httpx

    url = collector.start()
    job = "outage-live"
    # The agent's default retry backoff (up to 5 s): the backlog arrives seconds after the restart.
    env = {"DDPSCOPE_RETRY_MAX_S": "5"}
    for r in (0, 1):
        started.emitter(agent_env(url, tmp_path / "spool", job, rank=r, **env), 900, 20.0)  # 45 s of steps

    def steps_stored() -> int:
        r = httpx.get(f"{url}/api/v1/jobs/{job}/steps", params={"limit": 5000}, timeout=10)
        return len(r.json()["items"]) if r.status_code == 200 else 0

    deadline = time.monotonic() + 30
    while steps_stored() < 20 and time.monotonic() < deadline:
        time.sleep(0.2)
    collector.kill()
    time.sleep(12)  # longer than the 10 s a rank may stay quiet before it counts as silent
    collector.start()
    before = steps_stored()
    seen: set[tuple[str, str]] = set()
    end = time.monotonic() + 10
    while time.monotonic() < end:
        status = httpx.get(f"{url}/api/v1/jobs/{job}", timeout=10).json()["status"]
        kinds = [
            i["kind"] for i in httpx.get(f"{url}/api/v1/jobs/{job}/incidents", timeout=10).json()["items"]
        ]
        seen |= {("status", status)} | {("incident", k) for k in kinds}
        time.sleep(0.3)
    assert steps_stored() > before + 100  # the backlog did arrive meanwhile
    assert seen == {("status", "running")}, seen
