"""Crash durability on a real abort: gloo kills a rank ~1 ms after a mismatched all-reduce, and that
rank's record of the call (written to the spool before the call entered torch) and its fatal-signal
report (faulthandler's crash file, shipped by the shipper that outlives it) still reach a real
collector, which then names both ranks' sizes and the call site in a 'mismatch' incident."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.ddp.failure_jobs.runner import site
from tests.support.collector_proc import CollectorProc
from tests.support.procs import describe, run_ranks

JOB = Path(__file__).parent / "abort_jobs" / "mismatch_job.py"
DEADLINE_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def incidents(url: str, job: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/jobs/{job}/incidents", timeout=5) as resp:
        return list(json.load(resp)["items"])


def kill_shippers_of(spool_dir: Path) -> None:
    """SIGKILL, by pid, any shipper still tailing this test's spool (they exit by themselves once
    they have shipped; this only bounds a failing run)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if b"ddpscope.agent.shipper" in cmdline and str(spool_dir).encode() in cmdline:
                os.kill(int(entry), signal.SIGKILL)


def run_aborting_job(scenario: str, tmp_path: Path) -> tuple[int, list[dict[str, Any]], str]:
    """Run the job on 2 ranks against a real collector; return the aborted rank, the job's incidents
    once both a mismatch and that rank's crash are diagnosed (or the deadline passed), and a summary."""
    job = f"abort-{scenario}-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    with CollectorProc(f"sqlite:///{tmp_path}/x.db", log_path=tmp_path / "collector.log") as collector:
        url = collector.start()
        env = {
            "DDPSCOPE_URL": url,
            "DDPSCOPE_JOB": job,
            "DDPSCOPE_SPOOL_DIR": str(spool_dir),
            "DDPSCOPE_SHIPPER_LINGER_S": "30",
            "DDPSCOPE_HANG_TIMEOUT": "120",
            # The worker's rounds 10 s apart: what reaches the spool before the abort got there by
            # make_durable alone, not by a lucky 20 ms round (which made this pass 1 run in 2 without it).
            "DDPSCOPE_FLUSH_INTERVAL_S": "10",
        }
        try:
            results = run_ranks(JOB, 2, args=[scenario], env=env, timeout_s=DEADLINE_S)
            output = describe(results, tail=2000)
            aborted = [r.rank for r in results if r.returncode == -signal.SIGABRT]
            assert len(aborted) == 1, output  # gloo's enforce aborts the receiving rank only
            (dead,) = aborted
            deadline = time.monotonic() + DEADLINE_S
            found: list[dict[str, Any]] = []
            while time.monotonic() < deadline:
                found = incidents(url, job)
                if any(i["kind"] == "mismatch" for i in found) and crash_of(dead, found):
                    break
                time.sleep(0.25)
        finally:
            kill_shippers_of(spool_dir)
        summary = json.dumps(found, indent=1)[:6000]
        if not any(i["kind"] == "mismatch" for i in found):
            summary += f"\n{output}\n{collector.log_tail()}"
        return dead, found, summary


def crash_of(rank: int, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in found if i["kind"] in ("rank_crashed", "rank_error") and i["rank"] == rank]


def test_the_aborted_rank_s_last_collective_and_its_crash_reach_the_collector(tmp_path: Path) -> None:
    dead, found, summary = run_aborting_job("user", tmp_path)
    mismatches = [i for i in found if i["kind"] == "mismatch"]
    assert mismatches, f"no mismatch incident\n{summary}"
    (mismatch,) = mismatches
    # Both ranks' records of collective #4 are needed for the diagnosis: the aborted rank's one
    # was only ever in the spool because it was written there before the call entered torch.
    assert mismatch["seq"] == 4, summary
    assert "[8]" in mismatch["message"] and "[16]" in mismatch["message"], summary
    assert mismatch["call_site"].endswith(site("mismatch", JOB)), summary
    assert mismatch["culprit_ranks"], summary
    crashed = crash_of(dead, found)
    assert crashed, f"no fatal report of rank {dead}\n{summary}"
    assert "SIGABRT" in json.dumps(crashed), summary


def test_a_stray_user_all_reduce_against_an_engine_bucket_reaches_the_collector_from_both_sides(
    tmp_path: Path,
) -> None:
    # The layout check makes bucket shapes equal on every rank, not the ranks' sequences: here the
    # bucket all-reduce meets a larger stray user call, and gloo aborts the engine's side (the
    # smaller receiver): only a bucket record written before the launch can reach the collector.
    dead, found, summary = run_aborting_job("engine", tmp_path)
    mismatches = [i for i in found if i["kind"] == "mismatch"]
    assert len(mismatches) == 1, f"no mismatch incident\n{summary}"
    (mismatch,) = mismatches
    assert mismatch["culprit_ranks"] == [1], summary  # the user side, whichever rank died
    assert mismatch["call_site"].endswith(site("stray", JOB)), summary
    # Rank 0's side is its engine's bucket all-reduce, as it recorded it (one flat bucket).
    message = mismatch["message"]
    assert "[10000]" in message and "rank 0 issued all_reduce(SUM) [" in message, summary
    assert crash_of(dead, found) and "SIGABRT" in json.dumps(crash_of(dead, found)), summary
