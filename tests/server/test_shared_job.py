"""Two runs under one job id at once (``job_id_shared``), against a restart that is not one."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.conftest import decoded
from tests.server.test_incidents import T0, JobRecords, started


def _stats(job: JobRecords, rank: int, t: float, incarnation: int) -> None:
    """An ``agent_stats`` record of the rank's ``incarnation``-th process (its agent stream)."""
    current = job._incarnation.get(rank, 1)
    job._incarnation[rank] = incarnation
    job.add("agent_stats", rank, t, emitted=100, dropped={}, spool_bytes=0)
    job._incarnation[rank] = current


def _second_run(job: JobRecords, at: float) -> None:
    for r in range(job.world):
        job.start(r, at)


def test_a_second_run_started_under_a_running_jobs_id_is_named_with_both_processes() -> None:
    job = started(2)
    job.train(5)
    _second_run(job, T0 + 20)
    end = job.train(5, t=T0 + 21)
    for r in range(2):  # the first run's processes go on reporting, 40 s after the second started
        for t in (T0 + 30, T0 + 60):
            _stats(job, r, t, incarnation=1)
    (inc,) = [i for i in diagnose(job.snapshot(), end) if i.kind == "job_id_shared"]
    assert inc.culprit_ranks == [0, 1] and inc.rank == 0 and inc.time_s == T0 + 20
    assert inc.message.startswith(
        "Two runs report under job id job-a at once: rank 0 has a process (pid 1000"
    )
    assert "kept reporting 40 s after another started" in inc.message
    assert "ranks 0, 1 alike" in inc.message and "DDPSCOPE_JOB" in inc.message


def test_a_restart_whose_old_processes_stopped_first_is_not_a_second_run() -> None:
    job = started(2)
    job.train(5)
    for r in range(2):
        _stats(job, r, T0 + 15, incarnation=1)
        # Stamped just after the new start: the old agent's last flush, read on another launch's clock.
        _stats(job, r, T0 + 23, incarnation=1)
    _second_run(job, T0 + 20)
    end = job.train(5, t=T0 + 21)
    assert [i.kind for i in diagnose(job.snapshot(), end) if i.kind == "job_id_shared"] == []


def test_the_collector_names_a_shared_job_id_from_what_it_stored(storage) -> None:
    job = started(2)
    job.train(3)
    _second_run(job, T0 + 20)
    end = job.train(3, t=T0 + 21)
    _stats(job, 1, T0 + 45, incarnation=1)
    storage.write_batch(decoded(job.records))
    (inc,) = [i for i in diagnose(storage.load_snapshot(job.job), end) if i.kind == "job_id_shared"]
    assert inc.culprit_ranks == [1] and "rank 1 has a process (pid 1001" in inc.message
