"""End to end: a real Prometheus scrapes a real collector fed by a real 2-rank gloo job that hangs, and
``DDPJobHang`` fires through Prometheus' own API.

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

from tests.support.collector_proc import CollectorProc
from tests.support.procs import kill_group, started_ranks
from tests.support.prometheus import PROMETHEUS, fast_rules, running_prometheus
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
