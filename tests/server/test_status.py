"""Job status from synthetic snapshots: running, hung, finished, failed."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import DEFAULT_DEAD_AFTER_S, is_secondary, job_status, liveness
from tests.server.test_incidents import T0, inflight, started


def test_a_job_making_progress_is_running() -> None:
    job = started(4)
    end = job.train(10)
    assert job_status(job.snapshot(), end + 1) == "running"


def test_a_job_is_finished_once_every_rank_exited() -> None:
    job = started(3)
    end = job.train(3)
    job.exit(0, end)
    job.exit(1, end)
    assert job_status(job.snapshot(), end + 1) == "running"
    job.exit(2, end + 0.5)
    assert job_status(job.snapshot(), end + 1000) == "finished"


def test_an_abort_at_interpreter_exit_after_a_clean_exit_does_not_fail_the_job() -> None:
    job = started(2)
    end = job.train(3)
    job.exit(0, end)
    job.exit(1, end)
    job.error(1, end + 0.1, "terminate called without an active exception", error_type="SIGABRT")
    assert job_status(job.snapshot(), end + 1) == "finished"


def test_a_fatal_error_fails_the_job_even_when_every_rank_exited() -> None:
    job = started(2)
    end = job.train(3)
    job.error(1, end, "boom")
    job.exit(0, end + 0.1, reason="finished")
    job.exit(1, end + 0.1, reason="error")
    assert job_status(job.snapshot(), end + 1) == "failed"


def test_an_exit_with_reason_error_fails_the_job() -> None:
    job = started(2)
    end = job.train(3)
    job.exit(1, end, reason="error")
    assert job_status(job.snapshot(), end + 0.5) == "failed"


def test_a_caught_error_leaves_the_job_running() -> None:
    job = started(2)
    end = job.train(3)
    job.error(0, end, "retrying", fatal=False)
    assert job_status(job.snapshot(), end + 0.5) == "running"


def test_an_error_before_the_rank_restarted_is_history() -> None:
    job = started(2)
    end = job.train(2)
    job.error(1, end, "boom")
    job.start(1, end + 1)
    end2 = job.train(2, t=end + 2)
    assert job_status(job.snapshot(), end2) == "running"


def test_an_unresolved_hang_makes_the_job_hung_until_it_resolves() -> None:
    job = started(2)
    end = job.train(3)
    job.hang(0, end + 3, step=3, inflight=[inflight(7, end)], stalled_s=3)
    for r in range(2):
        job.heartbeat(r, end + 3.5, step=3)
    assert job_status(job.snapshot(), end + 4) == "hung"
    job.add("hang_resolved", 0, end + 5, step=3, hang_s=5.0)
    end2 = job.train(1, t=end + 5)
    assert job_status(job.snapshot(), end2) == "running"


def test_a_silent_rank_makes_the_job_hung() -> None:
    job = started(2)
    end = job.train(3)
    job.heartbeat(0, end + 20, step=3)
    snap = job.snapshot()
    assert job_status(snap, end + 21) == "hung"
    assert liveness(snap, end + 21).silent == [1]


def test_a_job_that_stopped_reporting_altogether_is_hung_for_a_while_then_failed() -> None:
    job = started(2)
    end = job.train(3)
    assert job_status(job.snapshot(), end + 5) == "running"
    # Quiet for a moment: killed, stopped, or cut off from the collector; it must not read as running.
    assert job_status(job.snapshot(), end + 60) == "hung"
    # Quiet for good (a scheduler killed every rank at once): dead, which is a failure, not a hang.
    assert job_status(job.snapshot(), end + 3600) == "failed"


def test_after_a_collector_restart_ranks_last_heard_before_it_get_time_for_their_backlog() -> None:
    from dataclasses import replace

    job = started(2)
    end = job.train(3)
    # The collector was down from `end` and came back 8 s later: the ranks' spooled records are still
    # on their way, so for a while they only look quiet.
    snap = replace(job.snapshot(), listening_since_s=end + 8)
    for now in (end + 9, end + 17):
        live = liveness(snap, now)
        assert (live.status, live.silent, live.lost) == ("running", [], False), now
        assert [i.kind for i in diagnose(snap, now)] == []
    # Nothing came after all: the job stopped reporting, as it would have been judged without a restart.
    assert job_status(snap, end + 8 + 11) == "hung"
    assert job_status(replace(snap, listening_since_s=end + 3600), end + 3600 + 11) == "failed"
    # A rank heard since the restart is judged as usual.
    job.heartbeat(0, end + 20, step=3)
    assert liveness(replace(job.snapshot(), listening_since_s=end + 8), end + 21).silent == [1]


def test_a_hung_job_killed_whole_stops_hanging_once_it_is_dead_and_its_hangs_end_with_it() -> None:
    job = started(2)
    end = job.train(3)
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end)])
    job.hang(1, end + 5, step=3, inflight=[inflight(7, end)])
    for r in range(2):
        job.heartbeat(r, end + 9, step=3, phase="allreduce")  # then SIGKILLed, every rank at once
    snap = job.snapshot()
    assert liveness(snap, end + 30).status == "hung" and sorted(liveness(snap, end + 30).active_hangs) == [
        0,
        1,
    ]
    dead = liveness(snap, end + 9 + DEFAULT_DEAD_AFTER_S + 1)
    assert dead.status == "failed" and dead.active_hangs == {} and sorted(dead.hangs_at_death) == [0, 1]
    hangs = [i for i in diagnose(snap, end + 9 + DEFAULT_DEAD_AFTER_S + 1) if i.kind == "hang"]
    assert [i.message.startswith("(ended when the whole job fell silent)") for i in hangs] == [True, True]
    # Part of the failure's story, not history.
    assert all(i.active for i in hangs)
    silent = next(i for i in diagnose(snap, end + 9 + DEFAULT_DEAD_AFTER_S + 1) if i.kind == "job_silent")
    assert "Ranks 0, 1 hung until then" in silent.message and "counts as dead (failed)" in silent.message


def test_a_killed_rank_fails_the_job_and_only_it_counts_as_crashed() -> None:
    job = started(3)
    end = job.train(3)
    job.error(0, end + 0.03, "Connection reset by peer")
    job.heartbeat(2, end + 0.05, step=3)  # rank 2 has not noticed yet, but it is alive
    snap = job.snapshot()
    assert liveness(snap, end + 0.1).crashed == [1]
    assert job_status(snap, end + 0.1) == "failed"


def test_peer_failures_are_recognised_as_secondary_errors() -> None:
    for message in ("Connection reset by peer", "Connection closed by peer", "Timed out waiting 1800000ms"):
        assert is_secondary({"error_type": "RuntimeError", "message": message})
    assert not is_secondary({"error_type": "RuntimeError", "message": "Expected to have finished reduction"})


def test_a_job_with_no_records_is_running() -> None:
    job = started(2)
    assert job_status(job.snapshot(), T0 + 1) == "running"


def test_an_abort_after_a_rank_already_died_of_a_peer_error_is_not_a_new_cause() -> None:
    job = started(2)
    end = job.train(3)
    job.error(0, end + 0.03, "Connection reset by peer")
    job.error(0, end + 0.2, "Fatal Python error: Aborted", error_type="SIGABRT")
    live = liveness(job.snapshot(), end + 1)
    assert [e["error_type"] for e in live.errors] == ["RuntimeError"]
    assert live.crashed == [1]
