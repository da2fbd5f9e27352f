"""The job page follows a real 2-rank gloo job (ddpscope's engine, agent pointed at a real collector)
while it runs: the heatmap grows step by step without the page reloading."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.browser.conftest import screenshot
from tests.browser.pages import WAIT_MS, figure, open_job, open_step, timeline_kinds
from tests.support.collector_proc import CollectorProc as Collector
from tests.support.procs import assert_all_ok, started_ranks, wait_all

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("live_job.py")
PAUSE_S, MAX_STEPS = 0.2, 3000
JOB_DEADLINE_S = 200.0


def steps_seen(collector: Collector, job: str) -> int:
    try:
        with urllib.request.urlopen(f"{collector.url}/api/v1/jobs/{job}", timeout=10) as resp:
            return int(json.loads(resp.read())["steps"])
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return 0
        raise


def api_items(collector: Collector, path: str) -> list[dict]:
    with urllib.request.urlopen(collector.url + path, timeout=10) as resp:
        return list(json.loads(resp.read())["items"])


def wait_for_steps(collector: Collector, job: str, at_least: int, deadline: float) -> int:
    while (seen := steps_seen(collector, job)) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} reported {seen} steps, expected {at_least} by the deadline")
        time.sleep(0.2)
    return seen


def test_job_page_updates_live_while_a_real_gloo_job_runs(collector: Collector, page, tmp_path: Path) -> None:
    job = f"live-gloo-{uuid.uuid4().hex[:8]}"
    env = {
        "DDPSCOPE_URL": collector.url,
        "DDPSCOPE_JOB": job,
        "DDPSCOPE_SPOOL_DIR": str(tmp_path / "spool"),
        "DDPSCOPE_SHIPPER_LINGER_S": "5",
    }
    stop_file = tmp_path / "stop"
    deadline = time.monotonic() + JOB_DEADLINE_S
    with started_ranks(SCRIPT, 2, args=[str(stop_file), str(PAUSE_S), str(MAX_STEPS)], env=env) as procs:
        wait_for_steps(collector, job, 3, deadline)
        open_job(page, collector.url, job)
        page.evaluate("window.__notReloaded = true")
        first = max(figure(page, "heatmap")["data"][0]["x"])
        # The job runs until told to stop: the heatmap must grow by itself while we wait.
        page.wait_for_function(
            "(n) => { const d = document.getElementById('heatmap'); return d.data && Math.max(...d.data[0].x) >= n; }",
            arg=first + 5, timeout=WAIT_MS)  # fmt: skip
        assert all(p.poll() is None for p in procs), "a rank ended before it was told to stop"
        assert page.evaluate("window.__notReloaded === true"), (
            "the page reloaded instead of updating in place"
        )
        assert figure(page, "heatmap")["data"][0]["y"] == [0, 1]
        screenshot(page, "job-page-live-gloo")
        stop_file.touch()
        results = wait_all(procs, max(1.0, deadline - time.monotonic()))
    assert_all_ok(results)
    # The finished job's last step: both ranks, every bucket of the engine's layout.
    n_buckets = len(api_items(collector, f"/api/v1/jobs/{job}/buckets"))
    assert n_buckets >= 2
    last = steps_seen(collector, job) - 1
    wait_until = time.monotonic() + 30  # the agents' last batches may still be on their way
    while len(api_items(collector, f"/api/v1/jobs/{job}/steps?start={last}&end={last}")) < 2:
        assert time.monotonic() < wait_until, f"step {last} never arrived from both ranks"
        time.sleep(0.2)
    open_step(page, collector.url, job, last)
    kinds = timeline_kinds(page)
    assert kinds["bucket ready"]["segments"] == 2 * n_buckets
    assert kinds["forward"]["segments"] == 2
    screenshot(page, "step-timeline-gloo")
