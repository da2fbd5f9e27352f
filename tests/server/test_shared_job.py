"""Two runs under one job id at once (``job_id_shared``), against a restart that is not one."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import job_status
from tests.server.conftest import decoded
from tests.server.test_incidents import T0, JobRecords, inflight, started


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


def _in_process(job: JobRecords, rank: int, incarnation: int) -> None:
    """Make ``rank``'s next records its ``incarnation``-th process's (agent stream)."""
    job._incarnation[rank] = incarnation


def test_a_second_process_given_a_ranks_number_that_stalls_in_its_set_up_is_a_duplicate_rank() -> None:
    # Launched as RANK=0, 1, 1 with WORLD_SIZE=2: the second rank 1 never gets through its DDP model's
    # construction (no rank_start): it waits in ddpscope's clock sync with rank 0, which pairs with the
    # first rank 1, reports that stall, and fails when the job, which trained, ends.
    job = started(2)
    end = job.train(10, t=T0 + 1, dt=1.0)
    _in_process(job, 1, 2)
    p2p = "default:p2p:0-1"
    job.coll(1, T0 + 1.5, 1, op="send", pg=p2p, site="train.py:24", done=False, step=0)
    job.hang(1, T0 + 7.5, step=0, inflight=[inflight(1, T0 + 1.5, pg=p2p)], stalled_s=6.0)
    job.error(1, end + 1, "[gloo] Read error [127.0.0.1]:11650: Connection reset by peer", fatal=True)
    _stats(job, 1, end + 1, incarnation=2)
    _in_process(job, 1, 1)
    for r in range(2):
        _stats(job, r, end, incarnation=1)
        job.exit(r, end + 0.5, step=9)
    # The twin's wait is not read as rank 1's: the job finished, and the only incident is the duplicate.
    assert job_status(job.snapshot(), end + 2) == "finished"
    (inc,) = diagnose(job.snapshot(), end + 2)
    assert inc.kind == "duplicate_rank" and inc.culprit_ranks == [1]
    assert inc.message.startswith(
        "Rank 1 has two processes at once, while rank 0 has one: rank 1's process (pid 1001"
    )
    assert "and another (that never announced itself" in inc.message and "stalled 6 s" in inc.message
    assert "then failed (RuntimeError: [gloo] Read error" in inc.message
    assert "One launch gave two processes the same RANK" in inc.message


def test_a_second_rank_0_that_fails_at_once_on_the_stores_port_is_a_duplicate_rank_not_a_restart() -> None:
    job = started(2)
    job.train(3)
    _in_process(job, 0, 2)
    job.error(0, T0 + 3, "The server socket has failed to listen on any local network address. port: 29500, "
              "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", fatal=True)  # fmt: skip
    _in_process(job, 0, 1)
    end = job.train(20, first=3, t=T0 + 4, dt=1.0)
    for r in range(2):
        _stats(job, r, end, incarnation=1)
    (inc,) = [i for i in diagnose(job.snapshot(), end) if i.kind in ("duplicate_rank", "job_id_shared")]
    assert inc.kind == "duplicate_rank" and inc.culprit_ranks == [0]
    assert "then failed" not in inc.message and "and failed (RuntimeError: The server socket" in inc.message


def test_a_rank_restarted_after_its_process_died_is_not_a_duplicate() -> None:
    job = started(2)
    job.train(3)
    job.error(1, T0 + 2, "CUDA-free failure", fatal=True)
    _stats(job, 1, T0 + 2.5, incarnation=1)
    job.start(1, T0 + 6)  # a supervisor relaunched this rank's process once the old one had died
    end = job.train(20, first=3, t=T0 + 7)
    assert [
        i.kind for i in diagnose(job.snapshot(), end) if i.kind in ("duplicate_rank", "job_id_shared")
    ] == []
