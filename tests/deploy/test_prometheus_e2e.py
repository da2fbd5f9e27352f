"""End to end: a real Prometheus scrapes a real collector. A real 2-rank gloo job that hangs fires
``DDPJobHang`` through Prometheus' own API, and the alert resolves once the ranks die; a failed job fires ``DDPRankSilent`` and the alert resolves
once the job's retention on /metrics ends, while a finished job of the same age never fires.

The rules are deploy/alerts.yml with every ``for`` shortened to 1 s and 1 s scrape and evaluation
intervals (``fast_rules``): the expressions under test are the shipped ones.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from ddpscope.server.settings import DEFAULT_METRICS_RETENTION_S
from tests.server.test_metrics import failed_job
from tests.support.collector_proc import CollectorProc
from tests.support.procs import kill_group, started_ranks
from tests.support.prometheus import PROMETHEUS, fast_rules, running_prometheus
from tests.support.synth import batch, synth_job
from tests.support.system import STRICT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which(PROMETHEUS) is None and not STRICT, reason="prometheus (Debian package) not installed"
    ),
]

HANG_JOB = Path(__file__).with_name("hang_job.py")
DEADLINE_S = 120.0
"""Whole-test budget; every process started is killed by pid when the test ends."""


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def post_records(url: str, records: list[dict[str, Any]]) -> None:
    body = json.dumps(batch(records)).encode()
    request = urllib.request.Request(
        f"{url}/api/v1/ingest", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


def test_a_hanging_job_fires_ddpjobhang_in_prometheus_with_the_job_and_rank(tmp_path: Path) -> None:
    job = f"e2e-hang-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with CollectorProc(
        f"sqlite:///{tmp_path / 'collector.db'}", log_path=tmp_path / "collector.log"
    ) as collector:
        url = collector.start()
        host_port = url.removeprefix("http://")
        with running_prometheus(tmp_path / "prometheus", targets=[host_port], rules=fast_rules()) as prom:
            env = {
                "DDPSCOPE_URL": url,
                "DDPSCOPE_JOB": job,
                "DDPSCOPE_HANG_TIMEOUT": "2",
                "DDPSCOPE_HEARTBEAT_S": "0.5",
                "DDPSCOPE_SPOOL_DIR": str(tmp_path / "spool"),
            }
            with started_ranks(HANG_JOB, 2, env=env) as procs:
                ranks_started = time.monotonic()
                remaining = DEADLINE_S - (time.monotonic() - started)
                try:
                    alert = prom.wait_for_alert(
                        "DDPJobHang", labels={"job": job, "rank": "0"}, timeout_s=remaining
                    )
                except AssertionError:
                    for p in procs:
                        kill_group(p)
                    logs = "\n".join(
                        f"--- rank {r}\n{p.communicate(timeout=10)[1][-2000:]}" for r, p in enumerate(procs)
                    )
                    raise AssertionError(f"DDPJobHang never fired; rank logs:\n{logs}") from None
                ranks_to_alert_s = time.monotonic() - ranks_started
                assert all(p.poll() is None for p in procs), "the ranks should still be hanging"
                incidents = get_json(f"{url}/api/v1/jobs/{job}/incidents")["items"]
                status = {j["job"]: j["status"] for j in get_json(f"{url}/api/v1/jobs")["items"]}

                # Now the culprit dies (SIGKILL): rank 0's all-reduce fails with "Connection reset by
                # peer" and rank 0 dies too (its fatal error, then a hang_resolved as its watchdog sees
                # the collective end, then its exit). The hang is over: the gauge drops to 0 while the
                # series stay (the job failed within its retention) and the alert resolves. A death
                # with no hang_resolved at all is covered by tests/server/test_metrics.py.
                kill_group(procs[1])
                deadline = time.monotonic() + max(5.0, DEADLINE_S - (time.monotonic() - started))
                hang_gauge = f'max by (job, rank) (ddpscope_hang_active{{job="{job}",rank="0"}}) == 0'
                while time.monotonic() < deadline:
                    firing = [a for a in prom.alerts() if a["labels"].get("job") == job]
                    if not firing and prom.query(hang_gauge):
                        break
                    time.sleep(0.5)
                else:
                    raise AssertionError(f"DDPJobHang still active after the ranks died: {firing}")
                after = {j["job"]: j["status"] for j in get_json(f"{url}/api/v1/jobs")["items"]}
    # Includes start-up (gloo rendezvous, 5 healthy steps), the 2 s hang timeout, 1 s scrapes and 'for'.
    print(f"DDPJobHang firing {ranks_to_alert_s:.1f} s after the ranks started")
    assert alert["state"] == "firing"
    assert alert["labels"]["severity"] == "page"
    assert alert["annotations"]["summary"] == f"DDP job {job} hangs: rank 0 makes no progress"
    assert f"/api/v1/jobs/{job}/incidents" in alert["annotations"]["description"]
    # The same evidence, diagnosed by the collector: rank 0 hangs, and rank 1 (which never entered the
    # all-reduce rank 0 waits in) is the culprit.
    assert status[job] == "hung"
    hang = next(i for i in incidents if i["kind"] == "hang" and i["rank"] == 0)
    assert hang["culprit_ranks"] == [1], incidents
    assert any(i["kind"] == "missing_collective" and i["culprit_ranks"] == [1] for i in incidents), incidents
    assert after[job] == "failed"


LEFT_S = 30.0
"""How long the ended jobs below still have on /metrics when they reach the collector: enough for
Prometheus to scrape them and fire (1 s scrapes), short enough for the test to see the end."""


def test_a_failed_job_fires_ddprank_silent_until_its_retention_ends_and_a_finished_one_never_does(
    tmp_path: Path,
) -> None:
    tag = uuid.uuid4().hex[:8]
    failed, done = f"e2e-failed-{tag}", f"e2e-done-{tag}"
    with CollectorProc(
        f"sqlite:///{tmp_path / 'collector.db'}", log_path=tmp_path / "collector.log"
    ) as collector:
        url = collector.start()
        with running_prometheus(
            tmp_path / "prometheus", targets=[url.removeprefix("http://")], rules=fast_rules()
        ) as prom:
            # Both jobs ended (retention - LEFT_S) ago by the collector's clock: silent far past the
            # rule's 60 s, and about to leave /metrics. The collector runs with the default retention.
            age_ns = int((DEFAULT_METRICS_RETENTION_S - LEFT_S) * 1e9)
            t0 = time.time_ns() - age_ns - 1_000_000_000
            post_records(url, failed_job(failed, t0_ns=t0))
            post_records(url, synth_job(2, 4, 2, job=done, t0_ns=t0))
            posted = time.monotonic()
            for rank in ("0", "1"):
                prom.wait_for_alert("DDPRankSilent", labels={"job": failed, "rank": rank}, timeout_s=LEFT_S)
            fired_s = time.monotonic() - posted
            # The finished job was scraped too (its ranks are marked finished), and pages for nothing.
            assert prom.query(f'ddpscope_rank_finished{{job="{done}"}} == 1'), "finished job never scraped"
            assert not [a for a in prom.alerts() if a["labels"].get("job") == done]

            deadline = posted + LEFT_S + 30
            while time.monotonic() < deadline:
                ours = [a for a in prom.alerts() if a["labels"].get("job") in (failed, done)]
                if not ours and not prom.query(f'ddpscope_last_seen_timestamp_seconds{{job="{failed}"}}'):
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"the failed job's alerts never resolved: {ours}\n{prom.log()}")
            resolved_s = time.monotonic() - posted
    print(
        f"DDPRankSilent firing {fired_s:.1f} s after the records arrived, resolved after {resolved_s:.1f} s"
    )
    # It left when its retention ended, not before: the alert had its window.
    assert resolved_s >= LEFT_S - 2
