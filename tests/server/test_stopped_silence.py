"""A rank that was silent when it was stopped keeps its diagnosis (synthetic records; the real jobs are in
``test_stopped_silence_jobs.py``).

A rank whose Python thread holds the GIL (a regex backtracking) or that is frozen (SIGSTOP) sends nothing,
heartbeats included, and reads ``rank_silent`` while it lasts. A scheduler's time limit or scancel then
stops the job: the rank's ``rank_exit('sigterm')`` used to read like any healthy rank's cancellation, so
the job became ``finished`` (unless a peer's wait failed it) and the silent rank's incident was gone.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import liveness
from tests.server.conftest import post
from tests.server.test_incidents import JobRecords, inflight, kinds, only, started

QUIET_S = 15.0
"""How long rank 1 holds the GIL before the job is stopped: over the collector's 10 s silent threshold."""


def gil_held_then_stopped(
    *, quiet_s: float = QUIET_S, catch_up: bool = True, peer_waits: bool = True
) -> tuple[JobRecords, float, float]:
    """Rank 1 enters a call that holds the GIL after step 2 and sends nothing more; rank 0 goes on (into the
    next step's all-reduce, where it waits, or its own work between steps), heartbeating every 2 s; then
    both are stopped by SIGTERM. ``catch_up``: rank 1's watchdog, starved of the GIL, sends its overdue
    heartbeat as the signal frees it, just before the exit, saying how long it could not run (the collector
    keeps only that heartbeat).
    Returns the records, when rank 1 fell quiet and when it was stopped."""
    job = started(2)
    end = job.train(3)
    quiet = end - 0.1  # its last step's records and heartbeat
    if peer_waits:
        job.coll(0, end, 7, site="ddp/reducer.py:88", done=False, step=3, source="engine")
    beats = [end + 2 * k for k in range(1, int(quiet_s / 2) + 1)]
    for t in beats:
        job.heartbeat(0, t, step=3, phase="allreduce" if peer_waits else "idle", last=7 if peer_waits else 6)
    stop = end + quiet_s
    if catch_up:
        catch_up_beat(job, 1, stop - 0.003, since=quiet)
    job.exit(1, stop, reason="sigterm", step=None)
    job.exit(0, stop + 0.5, reason="sigterm", step=None)  # blocked in gloo: the SIGTERM watcher's 0.5 s
    return job, quiet, stop


def catch_up_beat(job: JobRecords, rank: int, t: float, *, since: float) -> None:
    """The heartbeat a starved watchdog sends once it runs again, with how long it could not."""
    job.add("heartbeat", rank, t, phase="idle", step=2, last_coll_seq=6, pid=1000 + rank, silent_s=t - since)


@pytest.mark.parametrize("catch_up", [True, False], ids=["catch-up-heartbeat", "no-catch-up-heartbeat"])
def test_a_rank_silent_when_it_was_stopped_fails_the_job_and_keeps_its_rank_silent(catch_up: bool) -> None:
    job, quiet, stop = gil_held_then_stopped(catch_up=catch_up)
    during = diagnose(job.snapshot(), stop - 1)
    assert only(during, "rank_silent").rank == 1
    snap = job.snapshot()
    live = liveness(snap, stop + 5)
    assert live.status == "failed"
    assert live.stopped_silent == {1: pytest.approx(quiet)}
    incidents = diagnose(snap, stop + 5)
    silent = only(incidents, "rank_silent")
    assert (silent.rank, silent.culprit_ranks, silent.step) == (1, [1], 2)
    assert silent.time_s == pytest.approx(quiet)
    assert silent.message.startswith("Rank 1 sent nothing for 15 s (last "), silent.message
    assert "until it was stopped by SIGTERM: not even its heartbeat thread ran" in silent.message
    assert "held the GIL" in silent.message and "py-spy dump --native" in silent.message
    # Rank 0 waited for it in the next all-reduce, beating all along: it is no silent rank, and its wait
    # names rank 1.
    missing = only(incidents, "missing_collective")
    assert missing.culprit_ranks == [1]
    assert (
        "it had sent nothing for 15 s, heartbeats included, when it was stopped (sigterm)" in missing.message
    )
    assert "rank_exited_early" not in kinds(incidents)


def test_records_sent_as_the_stop_freed_the_rank_do_not_hide_its_silence() -> None:
    # As a real job sent them: rank 1's replica digest, queued just before it took the GIL, left only once
    # the stop freed the GIL, with the catch-up heartbeat and agent stats, all just before the exit.
    job = started(2)
    end = job.train(3)
    digest = {"step": 3, "syncs": 3, "model": 0, "parameters": 2, "group": 1, "norms": [1.0, 2.0]}
    job.add("replica_digest", 0, end - 0.05, **digest)
    for k in range(1, 8):
        job.heartbeat(0, end + 2 * k, step=3, phase="idle", last=6)
    stop = end + QUIET_S
    catch_up_beat(job, 1, stop - 0.003, since=end - 0.1)
    job.add("replica_digest", 1, end - 0.05, **digest)
    job.add("agent_stats", 1, stop - 0.002, emitted=40, dropped={}, spool_bytes=0)
    job.exit(1, stop, reason="sigterm", step=None)
    job.add("agent_stats", 1, stop + 0.001, emitted=42, dropped={}, spool_bytes=0)
    job.exit(0, stop + 0.01, reason="sigterm", step=None)
    live = liveness(job.snapshot(), stop + 5)
    assert live.status == "failed"
    assert live.stopped_silent == {1: pytest.approx(end - 0.1)}


def test_a_heartbeat_late_by_less_than_the_silent_threshold_at_the_stop_is_a_cancellation() -> None:
    job = started(2)
    end = job.train(3)
    stop = end + QUIET_S
    for r in range(2):
        for k in range(1, 6):
            job.heartbeat(r, end + 2 * k, step=2, phase="idle", last=6)
    catch_up_beat(job, 1, stop - 0.003, since=end + 10)  # 5 s without a heartbeat, then the stop
    for r in range(2):
        job.exit(r, stop, reason="sigterm", step=None)
    live = liveness(job.snapshot(), stop + 5)
    assert (live.status, live.stopped_silent) == ("finished", {})


def test_a_rank_silent_when_it_was_stopped_fails_the_job_even_when_no_peer_waited_for_it() -> None:
    job, quiet, stop = gil_held_then_stopped(peer_waits=False)
    snap = job.snapshot()
    assert liveness(snap, stop + 5).status == "failed"
    assert kinds(diagnose(snap, stop + 5)) == ["rank_silent"]


def test_a_rank_quiet_for_less_than_the_silent_threshold_when_it_was_stopped_is_a_cancellation() -> None:
    job, _, stop = gil_held_then_stopped(quiet_s=8.0, peer_waits=False)
    snap = job.snapshot()
    live = liveness(snap, stop + 5)
    assert (live.status, live.stopped_silent) == ("finished", {})
    assert diagnose(snap, stop + 5) == []


@pytest.mark.parametrize("last_beat_before_stop_s", [0.2, 1.5])
def test_a_healthy_job_stopped_while_its_ranks_worked_outside_collectives_is_finished(
    last_beat_before_stop_s: float,
) -> None:
    # A checkpoint write or an evaluation without collectives, longer than the silent threshold: no step or
    # collective record for 15 s, only heartbeats every 2 s; then a cancellation. The latest heartbeat,
    # sent just before the stop, says no silence (a starved thread's catching up would).
    job = started(2)
    end = job.train(3)
    for k in range(1, 8):
        for r in range(2):
            job.heartbeat(r, end + 2 * k, step=2, phase="idle", last=6)
    stop = end + 14 + last_beat_before_stop_s
    for r in range(2):
        job.exit(r, stop, reason="sigterm", step=None)
    snap = job.snapshot()
    live = liveness(snap, stop + 5)
    assert (live.status, live.stopped_silent) == ("finished", {})
    assert diagnose(snap, stop + 5) == []


def test_a_healthy_job_stopped_while_training_is_finished() -> None:
    job = started(2)
    end = job.train(30)
    for r in range(2):
        job.exit(r, end + 0.05, reason="sigterm", step=None)
    live = liveness(job.snapshot(), end + 5)
    assert (live.status, live.stopped_silent) == ("finished", {})


def test_a_silent_rank_that_never_reported_its_exit_is_named_when_its_peers_were_stopped() -> None:
    # Rank 1 was SIGSTOPped (or holds the GIL in code that never checks for signals): the SIGTERM does not
    # reach its handler, and the launcher's SIGKILL ends it without a word. Only rank 0's exit comes.
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="ddp/reducer.py:88", done=False, step=3, source="engine")
    for k in range(1, 8):
        job.heartbeat(0, end + 2 * k, step=3, phase="allreduce", last=7)
    job.exit(0, end + 15, reason="sigterm", step=None)
    snap = job.snapshot()
    live = liveness(snap, end + 20)
    assert live.status == "failed" and set(live.stopped_silent) == {1}
    incidents = diagnose(snap, end + 20)
    silent = only(incidents, "rank_silent")
    assert silent.culprit_ranks == [1]
    assert silent.message.startswith("Rank 1 had sent nothing for 15 s (last ")
    assert "when rank 0 was stopped by SIGTERM, and it never reported an exit" in silent.message
    missing = only(incidents, "missing_collective")
    assert missing.culprit_ranks == [1]
    assert "it had sent nothing for 15 s, heartbeats included, when its peers were stopped" in missing.message


def test_a_peers_hang_report_ended_by_the_stop_names_the_silent_rank() -> None:
    # A short hang timeout: rank 0 reported its wait before the job was stopped.
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="ddp/reducer.py:88", done=False, step=3, source="engine")
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end, "ddp/reducer.py:88")], stalled_s=5)
    for k in range(1, 8):
        job.heartbeat(0, end + 2 * k, step=3, phase="allreduce", last=7)
    catch_up_beat(job, 1, end + 15 - 0.003, since=end - 0.1)
    job.exit(1, end + 15, reason="sigterm", step=None)
    job.exit(0, end + 15.5, reason="sigterm", step=None)
    incidents = diagnose(job.snapshot(), end + 20)
    hang = only(incidents, "hang")
    assert hang.rank == 0 and hang.culprit_ranks == [1], hang.message
    assert hang.message.startswith("(ended when the rank was stopped by SIGTERM)")
    assert only(incidents, "rank_silent").culprit_ranks == [1]


def test_a_silent_rank_stopped_alone_is_the_cause_of_its_peers_lost_connection_not_an_early_exit() -> None:
    # An operator kills the frozen rank only; its peer, waiting for it, then loses its connection.
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="ddp/reducer.py:88", done=False, step=3, source="engine")
    for k in range(1, 8):
        job.heartbeat(0, end + 2 * k, step=3, phase="allreduce", last=7)
    job.exit(1, end + 15, reason="sigterm", step=None)
    job.error(0, end + 15.05, "Connection closed by peer", step=3)
    job.exit(0, end + 15.06, reason="error", step=3)
    incidents = diagnose(job.snapshot(), end + 20)
    assert "rank_exited_early" not in kinds(incidents)
    assert only(incidents, "rank_silent").culprit_ranks == [1]
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [1] and "the cause is on rank 1" in err.message, err.message


# ------------------------------------------------------------------------- through the collector's storage


def test_the_collector_sees_through_the_heartbeat_a_rank_sends_as_it_is_stopped(client: Any) -> None:
    # The heartbeats table keeps each rank's latest only: rank 1's catch-up heartbeat replaces the one
    # from before its silence, and says how long its thread could not run.
    job, quiet, stop = gil_held_then_stopped(peer_waits=False)
    assert post(client, job.records).status_code == 200
    stored = client.app.state.storage.load_snapshot(job.job)
    assert stored.heartbeats[1]["silent_s"] == pytest.approx(stop - 0.003 - quiet)
    assert client.get(f"/api/v1/jobs/{job.job}").json()["status"] == "failed"
    items = client.get(f"/api/v1/jobs/{job.job}/incidents").json()["items"]
    assert [(i["kind"], i["culprit_ranks"]) for i in items] == [("rank_silent", [1])]
    # /metrics: the silent rank did not finish (DDPRankSilent must still see it); its cancelled peer did.
    from tests.server.test_metrics import scrape, value

    samples = scrape(client, stop + 5)
    assert value(samples, "ddpscope_rank_finished", job.job, 1) == 0.0
    assert value(samples, "ddpscope_rank_finished", job.job, 0) == 1.0
