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

from tests.browser.conftest import Collector, screenshot
from tests.browser.pages import WAIT_MS, figure, open_job, open_step, timeline_kinds
from tests.support.procs import assert_all_ok, started_ranks, wait_all

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("live_job.py")
STEPS, PAUSE_S = 80, 0.25
JOB_DEADLINE_S = 150.0


def steps_seen(collector: Collector, job: str) -> int:
    try:
        with urllib.request.urlopen(f"{collector.url}/api/v1/jobs/{job}", timeout=10) as resp:
            return int(json.loads(resp.read())["steps"])
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return 0
        raise


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
    deadline = time.monotonic() + JOB_DEADLINE_S
    with started_ranks(SCRIPT, 2, args=[str(STEPS), str(PAUSE_S)], env=env) as procs:
        wait_for_steps(collector, job, 3, deadline)
        open_job(page, collector.url, job)
        page.evaluate("window.__notReloaded = true")
        first = max(figure(page, "heatmap")["data"][0]["x"])
        # The job is still running: the heatmap must grow by itself while we wait.
        page.wait_for_function(
            "(n) => { const d = document.getElementById('heatmap'); return d.data && Math.max(...d.data[0].x) >= n; }",
            arg=first + 5, timeout=WAIT_MS)  # fmt: skip
        assert page.evaluate("window.__notReloaded === true"), (
            "the page reloaded instead of updating in place"
        )
        heat = figure(page, "heatmap")["data"][0]
        assert heat["y"] == [0, 1]
        assert steps_seen(collector, job) < STEPS, "the job finished before the page was seen updating"
        screenshot(page, "job-page-live-gloo")
        results = wait_all(procs, max(1.0, deadline - time.monotonic()))
    assert_all_ok(results)
    wait_for_steps(collector, job, STEPS, time.monotonic() + 30)
    # The finished job's timeline: both ranks, every bucket of the engine's layout.
    with urllib.request.urlopen(f"{collector.url}/api/v1/jobs/{job}/buckets", timeout=10) as resp:
        n_buckets = len(json.loads(resp.read())["items"])
    assert n_buckets >= 2
    open_step(page, collector.url, job, STEPS - 1)
    kinds = timeline_kinds(page)
    assert kinds["bucket ready"]["segments"] == 2 * n_buckets
    assert kinds["forward"]["segments"] == 2
    screenshot(page, "step-timeline-gloo")
