"""A rank stuck outside any step, in a real 2-rank gloo job trained with ddpscope's engine: its own hang
report shows where it is stuck, while its peer waits for it in an all-reduce."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.ddp.failure_jobs.runner import JOBS, JobRun, read_records, site
from tests.support.procs import exited_cleanly, run_ranks

pytestmark = pytest.mark.slow

JOB = JOBS / "between_steps_job.py"
ENV = {"DDPSCOPE_HANG_TIMEOUT": "1.0", "DDPSCOPE_HEARTBEAT_S": "0.2", "JOB_STALL_S": "3.5"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """One job for the module: rank 1 blocks in set-up and between steps 3 and 4; both ranks evaluate
    with collectives between steps 1 and 2 (see the job script)."""
    out = tmp_path_factory.mktemp("between_steps")
    results = run_ranks(JOB, 2, args=[str(out)], env=ENV, timeout_s=120)
    run = JobRun(results, read_records(out, 2))
    assert all(exited_cleanly(r) for r in results), run.output()
    return run


def stuck_reports(job: JobRun, rank: int, phase: str = "idle") -> list[dict[str, Any]]:
    return [h for h in job.of(rank, "hang") if not h["inflight"] and h["phase"] == phase]


def main_stack(hang: dict[str, Any]) -> str:
    return str(next(s for s in hang["stacks"] if s["thread"] == "MainThread")["stack"])


def test_a_rank_blocked_between_steps_reports_its_hang_with_the_blocking_line_in_its_main_stack(
    job: JobRun,
) -> None:
    (hang,) = stuck_reports(job, 1)
    # The shape the collector reads as "stuck in its own code": idle, nothing in flight or pending.
    assert (hang["phase"], hang["step"], hang["inflight"], hang["pending_buckets"]) == ("idle", 3, [], [])
    assert hang["stalled_s"] >= 1.0
    stack = main_stack(hang)
    assert "batches.get(timeout=STALL_S)  # SITE:between_steps" in stack and "queue.py" in stack
    message = hang["message"]
    assert "between steps, after step 3 (the optimizer step, data loading or its own code)" in message
    assert re.search(rf"the main thread waits at \S*{re.escape(site('between_steps', JOB))};", message)
    assert "it is blocked, waiting" in message
    assert "No collective is in flight: this rank itself is stuck" in message


def test_a_rank_in_set_up_before_its_first_step_is_not_reported_while_its_peer_reports_its_wait(
    job: JobRun,
) -> None:
    assert [h for h in stuck_reports(job, 1) if h["step"] == 0] == []
    waits = [h for h in job.of(0, "hang") if h["step"] == 0]
    assert len(waits) == 1 and waits[0]["inflight"] and waits[0]["phase"] in ("backward", "allreduce")


def test_a_stuck_stretch_between_steps_ends_with_hang_resolved_once_the_next_forward_begins(
    job: JobRun,
) -> None:
    (hang,) = stuck_reports(job, 1)
    resolved = next(r for r in job.of(1, "hang_resolved") if r["time_ns"] > hang["time_ns"])
    assert resolved["hang_s"] >= hang["stalled_s"]
    assert resolved["step"] >= 4  # step 4's forward moved it (the watchdog samples a little later)


def test_the_peer_waits_in_an_all_reduce_meanwhile_and_an_evaluation_with_collectives_is_not_a_hang(
    job: JobRun,
) -> None:
    # Rank 0 never stops between steps: whatever it reported, it was waiting in a collective.
    assert stuck_reports(job, 0) == [] and stuck_reports(job, 0, "after_forward") == []
    assert {h["step"] for h in job.of(0, "hang")} == {0, 4, 5}
    # 3.5 s of evaluation between steps 1 and 2, 3.5 timeouts long: its all-reduces are progress.
    evaluation = [
        r for r in job.of(0, "collective") if (r.get("call_site") or "").endswith(site("evaluate", JOB))
    ]
    assert len(evaluation) >= 10
    for rank in (0, 1):
        assert [h for h in job.of(rank, "hang") if h["step"] == 1] == []


def test_a_rank_stuck_between_forward_and_backward_awaits_no_gradient_and_reports_its_own_line(
    job: JobRun,
) -> None:
    (hang,) = stuck_reports(job, 1, "after_forward")
    # Every bucket waits for gradients then, but none is due before backward begins: listing them as
    # missing read as unused parameters at the collector.
    assert (hang["step"], hang["pending_buckets"]) == (5, [])
    assert "threading.Event().wait(STALL_S)  # SITE:after_forward" in main_stack(hang)
    assert "in its own code between forward and backward" in hang["message"]
    assert "No collective is in flight: this rank itself is stuck" in hang["message"]
