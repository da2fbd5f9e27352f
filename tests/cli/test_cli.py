"""The ddpscope command against a real collector process: jobs, report, export and their exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.collector_proc import CollectorProc
from tests.support.procs import free_port
from tests.support.synth import batch, site_profile, synth_job


def _post(url: str, records: list[dict]) -> None:
    body = json.dumps(batch(records)).encode()
    request = urllib.request.Request(
        f"{url}/api/v1/ingest", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def ddpscope(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpscope.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("cli") / "cli.db"
    with CollectorProc(f"sqlite:///{db}") as proc:
        proc.start()
        _post(proc.url, synth_job(2, steps=12, buckets=3, job="cli-healthy"))
        slow = synth_job(4, steps=12, buckets=3, job="cli-slow", slow_rank=2, slowdown=1.6, jitter=0.0)
        sampled = [("forward", "model.py:40", 9), ("backward", "model.py:40", 9)]
        _post(proc.url, [*slow, site_profile("cli-slow", 2, max(r["time_ns"] for r in slow), sampled)])
        _post(
            proc.url, _crowded(synth_job(4, steps=12, buckets=3, job="cli-crowded", slow_rank=1, jitter=0.0))
        )
        _post(proc.url, _restarted_job("cli-restarted"))
        _post(proc.url, _died_mid_step("cli-died"))
        _post(proc.url, synth_job(2, steps=12, buckets=3, job="cli-needless", find_unused=True))
        # DDPSCOPE_JOB='team/exp-1' as the agent reports it (it warns: a job id has no '/').
        _post(proc.url, synth_job(2, steps=4, buckets=1, job="team_exp-1"))
        yield proc.url


def _crowded(records: list[dict]) -> list[dict]:
    """The job's 4 ranks, of one thread each, on one host of 2 CPUs (as ``make demo`` runs them)."""
    for r in records:
        if r["kind"] == "rank_start":
            r.update(host="node-1", host_cpus=2, cpus_allowed=2, threads=1)
    return records


def _restarted_job(job: str) -> list[dict]:
    """Rank 1 dies of an error at step 5; an hour later both ranks run again under the same job id."""
    first = synth_job(2, steps=6, buckets=3, job=job, finished=False)
    died_ns = max(r["time_ns"] for r in first) + 1000
    error = {"kind": "rank_error", "job": job, "rank": 1, "stream": f"{job}-r1", "seq": 10_000, "time_ns": died_ns,
             "step": 5, "phase": "backward", "error_type": "RuntimeError", "message": "CUDA out of memory",
             "stack": "Traceback (most recent call last):\nRuntimeError: CUDA out of memory", "fatal": True}  # fmt: skip
    again = synth_job(2, steps=6, buckets=3, job=job, t0_ns=died_ns + 3600 * 10**9)
    for r in again:
        r["stream"] += "-restarted"
    return [*first, error, *again]


def _died_mid_step(job: str) -> list[dict]:
    """Steps 0-5; in step 6 rank 1 is killed and rank 0 fails in bucket 2's all-reduce (bucket 1's done)."""
    records = synth_job(2, steps=6, buckets=3, job=job, finished=False)
    t = max(r["time_ns"] for r in records) + 1000
    ms = 1_000_000
    partial = {"step": 6, "synced": True, "forward_start_ns": t, "forward_end_ns": t + ms, "backward_start_ns": t + 2 * ms,
               "bucket_ready_ns": [0, t + 3 * ms, t + 4 * ms], "allreduce_start_ns": [0, 0, t + 4 * ms],
               "allreduce_end_ns": [0, 0, 0], "bucket_bytes": [4096] * 3}  # fmt: skip
    error = {"kind": "rank_error", "job": job, "rank": 0, "stream": f"{job}-r0", "seq": 10_000, "time_ns": t + 9 * ms,
             "step": 6, "phase": "backward", "error_type": "RuntimeError", "message": "Connection closed by peer",
             "stack": "Traceback (most recent call last):\nRuntimeError: Connection closed by peer", "fatal": True,
             "partial_step": partial}  # fmt: skip
    return [*records, error]


def test_report_of_a_job_that_died_mid_step_says_where_each_rank_stopped_and_which_parameters_were_in_flight(
    collector: str,
) -> None:
    out = ddpscope("report", "cli-died", "--url", collector)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "== Where it stopped: step 6, which no rank finished" in out.stdout, out.stdout
    assert "- rank 0 failed in backward, all-reduce of bucket 2 in flight\n" in out.stdout, out.stdout
    assert "  bucket 2: layers.0.weight, layers.0.bias\n" in out.stdout, out.stdout
    # A job that finished has no such section.
    assert "Where it stopped" not in ddpscope("report", "cli-healthy", "--url", collector).stdout


def test_jobs_lists_every_job_with_its_status(collector: str) -> None:
    out = ddpscope("jobs", "--url", collector)
    assert out.returncode == 0, out.stderr
    assert "cli-healthy" in out.stdout and "cli-slow" in out.stdout
    listed = json.loads(ddpscope("jobs", "--url", collector, "--json").stdout)
    assert {j["job"]: j["status"] for j in listed} == {
        "cli-healthy": "finished",
        "cli-slow": "finished",
        "cli-crowded": "finished",
        "cli-restarted": "finished",
        "cli-died": "failed",
        "cli-needless": "finished",
        "team_exp-1": "finished",
    }


def test_report_of_a_job_that_recovered_by_restarting_shows_the_old_crash_as_history_and_exits_zero(
    collector: str,
) -> None:
    out = ddpscope("report", "cli-restarted", "--url", collector)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== Incidents (0, and 1 resolved or before a restart)" in out.stdout
    assert "[rank_error] (history) rank 1, step 5" in out.stdout and "CUDA out of memory" in out.stdout
    # Its culprit is the old process: the current pid must not be printed next to it.
    assert "culprit ranks: 1\n" in out.stdout


def test_report_of_a_healthy_job_exits_zero_and_says_nothing_is_wrong(collector: str) -> None:
    out = ddpscope("report", "cli-healthy", "--url", collector)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== Incidents (0)" in out.stdout
    assert "no rank is consistently slower" in out.stdout


def test_report_names_the_straggler_and_exits_one(collector: str) -> None:
    out = ddpscope("report", "cli-slow", "--url", collector)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rank 2: 1.6" in out.stdout and "slower than the median of the others" in out.stdout
    assert ", at model.py:40 (9 of 9 samples taken there)" in out.stdout  # its watchdog's samples
    assert "share cores" not in out.stdout  # its agents said nothing of their host's CPUs


def test_a_straggler_on_a_host_with_more_threads_than_cores_is_told_so(collector: str) -> None:
    out = ddpscope("report", "cli-crowded", "--url", collector)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "- rank 1: 1.50x slower" in out.stdout
    assert (
        "  but host node-1 runs 4 ranks wanting 4 CPUs on 2: ranks that share cores are slowed unevenly"
        in out.stdout
    )


def test_report_of_an_unknown_job_exits_four_and_lists_the_known_ones(collector: str) -> None:
    out = ddpscope("report", "no-such-job", "--url", collector)
    assert out.returncode == 4
    assert "no job 'no-such-job'" in out.stderr and "cli-healthy" in out.stderr


def test_report_of_a_job_named_as_its_invalid_environment_value_names_the_id_it_was_reported_under(
    collector: str,
) -> None:
    out = ddpscope("report", "team/exp-1", "--url", collector)
    assert out.returncode == 4
    assert "no job 'team/exp-1' at the collector: that is not a valid job id" in out.stderr
    assert "ddpscope reported it as 'team_exp-1'; ask for that one" in out.stderr


def test_export_writes_a_perfetto_trace_of_the_requested_steps(collector: str, tmp_path: Path) -> None:
    target = tmp_path / "trace.json"
    out = ddpscope(
        "export", "cli-healthy", "-o", str(target), "--start", "2", "--end", "3", "--url", collector
    )
    assert out.returncode == 0, out.stderr
    events = json.loads(target.read_text())["traceEvents"]
    assert events and {e.get("pid") for e in events if e.get("ph") == "X"} >= {0, 1}


def test_export_of_an_unknown_job_exits_four_and_lists_the_known_ones(collector: str, tmp_path: Path) -> None:
    out = ddpscope("export", "no/such job", "-o", str(tmp_path / "t.json"), "--url", collector)
    assert out.returncode == 4, out.stderr
    assert "no job 'no/such job'" in out.stderr and "cli-healthy" in out.stderr
    assert not (tmp_path / "t.json").exists()


def test_export_to_dash_writes_the_trace_to_stdout(collector: str, tmp_path: Path) -> None:
    out = ddpscope("export", "cli-healthy", "-o", "-", "--url", collector)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["traceEvents"]
    assert "wrote stdout" in out.stderr


@pytest.mark.parametrize("url", ["http://[bad", "http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://"])
def test_a_url_that_cannot_be_parsed_is_a_usage_error_not_a_traceback(url: str) -> None:
    out = ddpscope("jobs", "--url", url)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "--url" in out.stderr


def test_an_unreachable_collector_exits_three_with_what_to_do() -> None:
    out = ddpscope("jobs", "--url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 3
    assert "cannot reach the collector" in out.stderr and "ddpscope serve" in out.stderr


def test_a_usage_error_exits_two() -> None:
    assert ddpscope("report").returncode == 2
    assert ddpscope("frobnicate").returncode == 2


def test_report_says_find_unused_parameters_is_set_for_nothing(collector: str) -> None:
    out = ddpscope("report", "cli-needless", "--url", collector)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "find_unused_parameters=True but no parameter was ever unused" in out.stdout
    healthy = ddpscope("report", "cli-healthy", "--url", collector)
    assert "find_unused_parameters" not in healthy.stdout
