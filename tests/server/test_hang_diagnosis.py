"""Hangs read against the other ranks, and the failures that end them: synthetic snapshots of the
scenarios exploratory testing found misdiagnosed (a data loader deadlock, a rank asleep in forward,
a hung job killed by its time limit, a stopped rank whose heartbeat lags its steps)."""

from __future__ import annotations

from typing import Any

import pytest

from ddpscope.server.analysis.incidents import Incident, diagnose
from ddpscope.server.analysis.status import job_status, liveness
from tests.server.test_incidents import T0, JobRecords, inflight, kinds, only, started


def stuck_hang(
    job: JobRecords,
    rank: int,
    t: float,
    *,
    step: int,
    phase: str,
    line: int = 12,
    cpu_s: float | None = None,
    stack: str | None = None,
    blocked_call: dict[str, Any] | None = None,
    loader_workers: list[dict[str, Any]] | None = None,
) -> None:
    """A hang report with nothing in flight: the main thread sits in user code (traceback format), or at
    ``stack``; ``blocked_call``: the system call it sits in, as the watchdog read it; ``loader_workers``: its
    DataLoader's workers, as it read them."""
    main = stack or (
        '  File "/proj/train.py", line 80, in <module>\n'
        f'  File "/proj/data.py", line {line}, in next_batch\n'
        '  File "/usr/lib/python3.11/threading.py", line 629, in wait\n'
    )
    stacks = [
        {"thread": "ddpscope-agent", "stack": '  File "/work/agent/worker.py", line 107, in _run\n'},
        {"thread": "MainThread", "stack": main},
    ]
    extra: dict[str, Any] = {"blocked_call": blocked_call} if blocked_call else {}
    if loader_workers:
        extra["loader_workers"] = loader_workers
    job.add("hang", rank, t, phase=phase, step=step, stalled_s=5.0, pending_buckets=[], inflight=[],
            stacks=stacks, message="no progress", main_cpu_s=cpu_s, **extra)  # fmt: skip


def waiting_in(job: JobRecords, rank: int, t: float, seq: int, *, step: int) -> None:
    job.coll(rank, t - 5, seq, site="train.py:57", done=False, step=step)
    job.hang(rank, t, step=step, inflight=[inflight(seq, t - 5)])


def test_a_rank_blocked_after_one_of_its_threads_died_is_told_that_the_thread_is_what_it_waits_for() -> None:
    # A prefetch thread raised on a corrupt record after step 1; the main thread then waits on its queue.
    job = started(2)
    end = job.train(3)
    job.add("rank_error", 1, end - 0.1, step=1, phase="idle", error_type="ValueError",
            message="corrupt record 30 in shard-0001.tar", fatal=False, thread="prefetcher",
            stack='Traceback (most recent call last):\n  File "/proj/data.py", line 40, in produce\n'
                  "ValueError: corrupt record 30 in shard-0001.tar\n")  # fmt: skip
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=2, phase="idle", cpu_s=0.0)
    incidents = diagnose(job.snapshot(), end + 6)
    died = "after its thread 'prefetcher' died (ValueError: corrupt record 30 in shard-0001.tar at /proj/data.py:40)"
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert died in hangs[0].message and died.removeprefix("after") in hangs[1].message, hangs[1].message
    error = only(incidents, "rank_error")
    assert error.message.startswith(
        "Rank 1's thread 'prefetcher' died (the rank kept running) after step 1"
    ), error
    # A main thread computing all along is not waiting for anything that thread made.
    busy = started(2)
    end = busy.train(3)
    busy.records += [r for r in job.records if r["kind"] == "rank_error"]
    waiting_in(busy, 0, end + 5, 7, step=3)
    stuck_hang(busy, 1, end + 5, step=2, phase="idle", cpu_s=5.0)
    assert "prefetcher" not in " ".join(
        i.message for i in diagnose(busy.snapshot(), end + 6) if i.kind == "hang"
    )


def test_a_rank_stuck_in_its_data_loader_is_the_culprit_of_its_peers_hang_and_of_its_own() -> None:
    job = started(2)
    end = job.train(3)  # collectives 1..6
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=2, phase="idle")
    incidents = diagnose(job.snapshot(), end + 6)
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1]
    assert (
        "rank 1 (never issued collective #7 of group default; stuck between steps after step 2 at /proj/data.py:12"
        in hangs[0].message
    )
    assert hangs[1].culprit_ranks == [1] and hangs[1].call_site == "/proj/data.py:12"
    assert "outside any collective, while rank 0 waits for it" in hangs[1].message
    assert "worker.py" not in (hangs[1].stack or "")  # ddpscope's own threads are left out
    missing = only(incidents, "missing_collective")
    assert "stuck between steps after step 2 at /proj/data.py:12" in missing.message
    assert "alive, doing something else" not in missing.message


def hangs_of_a_rank_stuck_at(
    stack: str, *, stuck: int, loader_workers: list[dict[str, Any]] | None = None
) -> dict[int, Incident]:
    """The hang incidents, by rank, of a 2-rank job whose rank ``stuck`` is blocked at ``stack`` between
    steps while the other waits for it in the next collective."""
    job = started(2)
    end = job.train(3)
    waiting_in(job, 1 - stuck, end + 5, 7, step=3)
    stuck_hang(
        job, stuck, end + 5, step=2, phase="idle", cpu_s=0.0, stack=stack, loader_workers=loader_workers
    )
    return {i.rank: i for i in diagnose(job.snapshot(), end + 6) if i.kind == "hang"}


LOADER_STACK = (
    '  File "/proj/train.py", line 14, in <module>\n'
    '  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 725, in __next__\n'
    '  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1291, in _try_get_data\n'
    '  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113, in get\n'
    '  File "/usr/lib/python3.11/multiprocessing/connection.py", line 947, in wait\n'
    '  File "/usr/lib/python3.11/selectors.py", line 415, in select\n'
)
"""torch 2.13: a main thread waiting for a batch its DataLoader worker never delivers (num_workers=1)."""


@pytest.mark.parametrize(
    ("stack", "loader"),
    [
        (LOADER_STACK, True),
        # num_workers=0: the dataset runs in the main thread, its own line is innermost and says where.
        (LOADER_STACK.replace("  File \"/usr/lib/python3.11/multiprocessing/queues.py", '  File "/proj/data.py", '
         'line 9, in __getitem__\n  File "/usr/lib/python3.11/multiprocessing/queues.py'), False),
    ],
)  # fmt: skip
def test_a_rank_whose_data_loader_workers_deliver_no_batch_is_said_to_wait_for_them(
    stack: str, loader: bool
) -> None:
    hangs = hangs_of_a_rank_stuck_at(stack, stuck=1)
    said = "waiting inside its DataLoader for the next batch, which its worker processes did not deliver"
    assert (said in hangs[0].message) is loader and (said in hangs[1].message) is loader
    assert hangs[0].culprit_ranks == hangs[1].culprit_ranks == [1]


def test_what_the_dataloaders_workers_are_blocked_in_is_said_by_the_rank_and_its_peer() -> None:
    nfs = {"syscall": "read", "on": [{"fd": 7, "kind": "file", "name": "/mnt/nfs/shard-17.bin"}]}
    hangs = hangs_of_a_rank_stuck_at(LOADER_STACK, stuck=1, loader_workers=[{"pid": 4242, "blocked_call": nfs},
                                     {"pid": 4243}])  # fmt: skip
    said = (
        "turns such a wait into an error); its workers: worker 4242 waiting on the file /mnt/nfs/shard-17.bin "
        "(read): a slow or unresponsive file system (a network mount), or a lock another process holds; worker "
        "4243 running, not blocked (computing"
    )
    assert said in hangs[1].message and said in hangs[0].message, hangs[1].message


@pytest.mark.parametrize(
    ("cpu_s", "said"),
    [
        (4.9, "at /proj/data.py:12, computing all along (a loop that does not end"),
        (0.01, "at /proj/data.py:12, blocked, using no CPU (waiting on a lock, I/O, a queue or a sleep)"),
    ],
)
def test_the_peer_a_rank_waits_for_is_said_to_be_computing_or_blocked_from_its_cpu_in_the_stall(
    cpu_s: float, said: str
) -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=3, phase="forward", cpu_s=cpu_s)  # 5 s stalled
    incidents = diagnose(job.snapshot(), end + 6)
    assert said in only(incidents, "missing_collective").message
    assert said in next(i for i in incidents if i.kind == "hang" and i.rank == 0).message
    own = next(i for i in incidents if i.kind == "hang" and i.rank == 1).message
    assert (
        "computing all along (a loop" if cpu_s > 1 else "blocked, using no CPU (waiting on a lock"
    ) in own, own
    assert ", outside any collective" in own, own


STORE_WAIT = {"syscall": "poll", "on": [{"fd": 13, "kind": "tcp", "name": "10.0.0.4:29500", "role": "store"}]}
"""torch 2.13's ``store.wait([key])`` on the default group's TCPStore, as ``agent/blocked_call.py`` reads it."""


def test_the_peer_a_rank_waits_for_is_said_to_wait_on_what_its_blocked_call_names() -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=2, phase="idle", cpu_s=0.01, blocked_call=STORE_WAIT)
    incidents = diagnose(job.snapshot(), end + 6)
    said = (
        "blocked, using no CPU, waiting on the process group's store at 10.0.0.4:29500 (poll): a store.wait()"
    )
    waiting = next(i for i in incidents if i.kind == "hang" and i.rank == 0).message
    assert said in waiting and "(waiting on a lock, I/O" not in waiting, waiting
    own = next(i for i in incidents if i.kind == "hang" and i.rank == 1).message
    assert "blocked, using no CPU, waiting on the process group's store at 10.0.0.4:29500 (poll)" in own, own


def test_a_blocked_call_read_while_the_thread_was_busy_is_not_said() -> None:
    """A thread that computed through the stall and sat in a system call for a moment as it was read."""
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=2, phase="idle", cpu_s=4.9, blocked_call={"syscall": "futex"})
    incidents = diagnose(job.snapshot(), end + 6)
    for i in incidents:
        assert "futex" not in i.message, i.message
    assert "computing all along" in next(i for i in incidents if i.kind == "hang" and i.rank == 0).message


def test_a_rank_stopped_while_stuck_in_its_own_code_is_said_where_it_was_stuck_then_how_it_ended() -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=2, phase="idle")
    for r in range(2):  # the operator stops the hung job; the agent's rank_exit does not know the step
        job.exit(r, end + 8, reason="sigterm", step=None)
    missing = only(diagnose(job.snapshot(), end + 9), "missing_collective")
    assert (
        "stuck between steps after step 2 at /proj/data.py:12 (its hang report), until it exited (sigterm)"
        in (missing.message)
    )
    assert "None" not in missing.message


def test_a_peer_that_entered_the_awaited_collective_late_is_named_not_the_backend() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="train.py:57", step=3)
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end)])
    job.coll(1, end + 20, 7, site="train.py:57", step=3)  # it slept 20 s in forward first
    job.add("hang_resolved", 0, end + 20.1, step=3, hang_s=20.1)
    hang = only(diagnose(job.snapshot(), end + 21), "hang")
    assert hang.culprit_ranks == [1] and "entered collective #7 20 s late" in hang.message
    assert "inside the backend" not in hang.message
    assert not hang.active and "made no progress for 20 s" in hang.message


def test_a_hang_where_every_peer_issued_the_collective_in_time_points_at_the_backend() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="train.py:57", step=3, done=False)
    job.coll(1, end + 0.001, 7, site="train.py:57", step=3, done=False)
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end)])
    job.heartbeat(1, end + 5, step=3, phase="allreduce", last=7)
    hang = only(diagnose(job.snapshot(), end + 5.5), "hang")
    assert hang.culprit_ranks == [] and "every rank issued this collective in time" in hang.message


def test_a_hung_job_stopped_by_sigterm_is_failed_and_keeps_its_hang_and_culprit() -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    job.heartbeat(1, end + 5, step=2, phase="idle", last=6)
    for r in range(2):  # the scheduler's time limit
        job.exit(r, end + 30, reason="sigterm", step=3)
    snap = job.snapshot()
    assert job_status(snap, end + 40) == "failed"
    hang = only(diagnose(snap, end + 40), "hang")
    assert hang.active and hang.message.startswith("(ended when the rank was stopped by SIGTERM)")
    assert hang.culprit_ranks == [1] and "never issued collective #7" in hang.message
    assert "made no progress for 30 s" in hang.message


@pytest.mark.parametrize(
    ("reason", "signal"), [("sigterm", "SIGTERM"), ("sigint", "SIGINT or an uncaught KeyboardInterrupt")]
)
def test_a_job_cancelled_while_a_rank_waited_before_any_hang_report_is_failed_and_keeps_the_culprit(
    reason: str, signal: str
) -> None:
    # The hang timeout (5 minutes by default) had not passed: no hang report, only rank 0's collective
    # #7 open for 20 s while rank 1, alive and beating, never issued it. Then the job was cancelled.
    job = started(2)
    end = job.train(3)
    job.coll(0, end + 1, 7, site="train.py:57", done=False, step=3)
    job.heartbeat(1, end + 19, step=2, phase="idle", last=6)
    for r in range(2):
        job.exit(r, end + 21, reason=reason, step=3)
    snap = job.snapshot()
    assert job_status(snap, end + 30) == "failed"
    missing = only(diagnose(snap, end + 30), "missing_collective")
    assert missing.culprit_ranks == [1]
    assert missing.message.startswith(
        f"Rank 0 waited 20 s in all_reduce(SUM) [4] float32 at train.py:57, collective #7 of group default, until it was "
        f"stopped by {signal}; rank 1 never issued it"
    ), missing.message


def test_a_wait_ended_by_the_lost_connection_as_the_stuck_peer_was_cancelled_first_is_still_a_wait() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end + 1, 7, site="train.py:57", done=False, step=3)
    job.heartbeat(1, end + 19, step=2, phase="idle", last=6)
    job.exit(1, end + 21, reason="sigterm", step=2)  # the launcher stops rank 1 first
    job.add("collective_end", 0, end + 21.05, pg="default", coll_seq=7, end_ns=int((end + 21.05) * 1e9),
            ok=False, error="Connection closed by peer")  # fmt: skip
    job.exit(0, end + 21.06, reason="sigterm", step=3)
    snap = job.snapshot()
    assert job_status(snap, end + 30) == "failed"
    assert only(diagnose(snap, end + 30), "missing_collective").culprit_ranks == [1]


def test_a_job_cancelled_in_a_short_collective_still_counts_as_finished() -> None:
    job = started(2)
    end = job.train(3)
    for r in range(2):  # a preemption lands while the step's all-reduce runs: no wait to speak of
        job.coll(r, end + 1, 7, done=False, step=3)
        job.exit(r, end + 1.2, reason="sigterm", step=3)
    snap = job.snapshot()
    assert job_status(snap, end + 5) == "finished"
    assert not diagnose(snap, end + 5)


def test_a_healthy_job_stopped_by_sigterm_counts_as_finished() -> None:
    job = started(2)
    end = job.train(3)
    for r in range(2):  # a cancellation or a preemption: nothing went wrong inside the job
        job.exit(r, end, reason="sigterm", step=2)
    assert job_status(job.snapshot(), end + 1) == "finished"


def test_a_timeout_on_every_rank_is_blamed_on_the_rank_whose_hang_report_shows_it_stuck_outside() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="train.py:57", step=3, done=False)
    stuck_hang(job, 1, end + 5, step=3, phase="forward", line=19)
    job.error(0, end + 10, "[gloo] Timed out waiting 10000ms for recv operation to complete", step=3)
    job.error(1, end + 25.5, "Connection closed by peer", step=3)
    err = only(diagnose(job.snapshot(), end + 26), "rank_error")
    assert err.culprit_ranks == [1]
    assert "rank 1 was stuck in forward at step 3 at /proj/data.py:19" in err.message
    assert "no rank reported a cause" not in err.message


def test_a_peer_that_fell_silent_heartbeats_and_all_is_said_to_have_been_stopped_frozen_or_cut_off() -> None:
    # Rank 1 is SIGSTOPped after step 2: no hang report, no error, not even a heartbeat. Rank 0 waits in
    # step 3's all-reduce, reports its hang, and dies of the group's 20 s timeout.
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    for t in range(1, 20, 2):
        job.heartbeat(0, end + t, step=3, phase="allreduce", last=7)
    job.error(0, end + 20, "[gloo] Timed out waiting 20000ms for recv operation to complete", step=3)
    incidents = diagnose(job.snapshot(), end + 21)
    said = "had sent nothing for 20 s by then, heartbeats included: its whole process was stopped (SIGSTOP"
    hang = next(i for i in incidents if i.kind == "hang" and i.rank == 0)
    assert (
        hang.culprit_ranks == [1]
        and f"never issued collective #7 of group default; it {said}" in hang.message
    )
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [1] and f"which rank 1 never issued; rank 1 {said}" in err.message, (
        err.message
    )


def test_a_peer_that_kept_sending_heartbeats_while_it_never_issued_the_call_is_not_said_to_be_silent() -> (
    None
):
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    for t in range(1, 20, 2):
        job.heartbeat(1, end + t, step=2, phase="idle", last=6)  # alive, in code of its own
    job.error(0, end + 20, "[gloo] Timed out waiting 20000ms for recv operation to complete", step=3)
    for i in diagnose(job.snapshot(), end + 21):
        assert "had sent nothing" not in i.message, i.message


def test_a_rank_stuck_between_forward_and_backward_is_said_to_be_in_its_own_code_there() -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 5, step=3, phase="after_forward", line=19)
    hangs = {i.rank: i for i in diagnose(job.snapshot(), end + 6) if i.kind == "hang"}
    assert hangs[0].culprit_ranks == hangs[1].culprit_ranks == [1]
    assert (
        "phase after_forward (between forward and backward: the loss, or other code of its own)"
        in hangs[1].message
    )
    assert "stuck in its own code, outside any collective" in hangs[1].message
    assert "find_unused_parameters" not in hangs[1].message
    job.error(0, end + 10, "[gloo] Timed out waiting 10000ms for recv operation to complete", step=3)
    err = only(diagnose(job.snapshot(), end + 11), "rank_error")
    assert err.culprit_ranks == [1]
    assert "rank 1 was stuck between forward and backward at step 3 at /proj/data.py:19" in err.message


def test_a_stopped_ranks_position_comes_from_its_last_step_when_its_heartbeat_is_older() -> None:
    job = started(2)
    t = T0 + 1
    job.heartbeat(1, t, step=0, phase="idle", last=0)  # its only heartbeat: a fast job outpaces them
    for s in range(8):
        for r in range(2):
            seqs = [2 * s + 1, 2 * s + 2]
            for seq in seqs:
                job.coll(r, t, seq, site="ddp/reducer.py:88", step=s, source="engine")
            job.step(r, t, s, seqs=seqs)
        job.heartbeat(0, t, step=s, phase="backward", last=2 * s + 2)
        t += 0.1
    waiting_in(job, 0, t + 5, 17, step=8)
    job.heartbeat(0, t + 15, step=8, phase="allreduce", last=17)
    silent = only(diagnose(job.snapshot(), t + 15), "rank_silent")
    assert silent.step == 7 and "last completed step 7" in silent.message
    assert "step 0" not in silent.message


def test_a_job_killed_after_one_rank_fell_quiet_names_that_rank_and_stops_the_clock() -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    for k in range(1, 10):  # rank 0 keeps reporting while it waits; rank 1 went quiet at `end`
        job.heartbeat(0, end + 5 + 2 * k, step=3, phase="allreduce", last=7)
    incidents = diagnose(job.snapshot(), end + 300)  # both killed at ~end + 23, looked at much later
    silent = only(incidents, "job_silent")
    assert silent.culprit_ranks == [1] and "Rank 1 fell quiet 23 s before the others" in silent.message
    missing = only(incidents, "missing_collective")
    assert "waited 23 s" in missing.message and "alive, doing something else" not in missing.message


def test_a_missing_rank_quiet_for_a_few_heartbeats_is_not_said_to_be_alive() -> None:
    # SIGSTOP: for the first seconds the rank is neither silent (10 s) nor known to be anything else.
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    job.heartbeat(0, end + 8, step=3, phase="allreduce", last=7)
    early = only(diagnose(job.snapshot(), end + 3), "missing_collective")
    assert "it is alive, doing something else" in early.message
    later = only(diagnose(job.snapshot(), end + 8), "missing_collective")
    assert "it has sent nothing for 8 s, heartbeats included (called silent after 10 s)" in later.message


def test_collectives_its_peers_completed_count_as_issued_by_a_rank_whose_records_lag() -> None:
    job = started(2)
    end = job.train(3)  # both: 1..6
    for seq in (7, 8):
        job.coll(0, end + 0.01 * seq, seq, site="ddp/reducer.py:88", step=3, source="engine")
    waiting_in(job, 0, end + 5, 9, step=4)
    incidents = diagnose(job.snapshot(), end + 16)
    missing = only(incidents, "missing_collective")
    assert missing.seq == 9 and missing.culprit_ranks == [1]
    assert "its peers completed #8 with it" in missing.message


def test_the_same_error_on_every_rank_is_one_incident_with_every_rank_an_origin() -> None:
    job = started(2)
    end = job.train(2)
    for r in range(2):
        job.add("rank_error", r, end + 0.01 * r, step=None, phase="idle",
                error_type="RuntimeError", message="register_comm_hook can only be called once.",
                stack="Traceback", fatal=True)  # fmt: skip
    err = only(diagnose(job.snapshot(), end + 1), "rank_error")
    assert err.culprit_ranks == [0, 1] and "rank 1 reported the same error" in err.message
    assert "the cause is in code they all run" in err.message


def test_the_engines_different_model_error_is_one_incident_blamed_on_the_odd_rank_before_any_step() -> None:
    job = started(2)
    msg = (
        "DistributedDataParallel: the ranks do not wrap the same model. Ranks [1] differ from rank 0 at position 0 "
        "of the parameter list: rank 0 has parameter l1.weight float32[64, 32]; rank 1 has parameter l1.weight "
        "float32[65, 32]. Every rank must build the same model (same parameter names, shapes, dtypes, "
        "requires_grad and order) before wrapping it."
    )
    for r in range(2):
        job.add("rank_error", r, 1_700_000_001.0, step=0, phase="idle", error_type="ValueError", message=msg,
                stack="Traceback", fatal=True)  # fmt: skip
    incidents = diagnose(job.snapshot(), 1_700_000_002.0)
    assert kinds(incidents) == ["rank_error"]
    err = incidents[0]
    assert err.culprit_ranks == [1] and err.rank == 1
    assert "before its first step" in err.message and "after step 0" not in err.message
    assert (
        "requires_grad and order) before wrapping it; rank 0 reported" in err.message
    )  # not cut mid-sentence


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        ("sigterm", "Rank 1 was stopped by SIGTERM after step 2"),
        ("sigint", "Rank 1 was stopped by SIGINT or an uncaught KeyboardInterrupt after step 2"),
    ],
)
def test_a_rank_stopped_by_a_signal_alone_is_told_apart_from_uneven_inputs(reason: str, said: str) -> None:
    job = started(2)
    end = job.train(3)
    job.exit(1, end, reason=reason, step=2)
    job.train(1, t=end + 0.1, ranks=[0], first=3)
    job.error(0, end + 0.5, "Connection closed by peer", step=4)
    early = only(diagnose(job.snapshot(), end + 1), "rank_exited_early")
    assert early.message.startswith(said) and early.culprit_ranks == [1]
    assert "Join" not in early.message and "while rank 0 was still training" in early.message
    assert ("check the scheduler's and the launcher's logs" in early.message) == (reason == "sigterm")
    assert ("Something interrupted this rank alone" in early.message) == (reason == "sigint")


def test_a_rank_stopped_by_the_launcher_after_its_peer_timed_out_waiting_for_it_is_no_early_exit() -> None:
    # Rank 1 is stuck between steps; rank 0's process-group timeout kills it, and torchrun then stops
    # rank 1 with SIGTERM a second later: the stuck rank is the culprit, its SIGTERM is the teardown.
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="train.py:57", step=3, done=False)
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end)])
    stuck_hang(job, 1, end + 5, step=2, phase="idle", line=19)
    job.error(0, end + 8, "[gloo] Timed out waiting 8000ms for recv operation to complete", step=3)
    job.exit(0, end + 8.01, reason="error", step=3)
    job.exit(1, end + 9, reason="sigterm", step=2)
    incidents = diagnose(job.snapshot(), end + 10)
    assert "rank_exited_early" not in kinds(incidents), [i.message for i in incidents]
    assert only(incidents, "rank_error").culprit_ranks == [1]
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1] and hangs[1].culprit_ranks == [1]
    assert "stuck in its own code" in hangs[1].message and "(its hang report)" not in hangs[1].message


def test_a_hung_job_interrupted_by_ctrl_c_keeps_its_hang_ended_by_that_signal() -> None:
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    job.heartbeat(1, end + 5, step=2, phase="idle", last=6)
    for r in range(2):  # torchrun forwards Ctrl-C to every worker
        job.exit(r, end + 30, reason="sigint", step=3)
    hang = only(diagnose(job.snapshot(), end + 40), "hang")
    assert hang.active and hang.message.startswith("(ended when the rank was stopped by SIGINT")
    assert hang.culprit_ranks == [1]


def test_a_timeout_on_a_rank_waiting_for_a_stopped_peer_blames_that_peer_and_does_not_call_it_crashed() -> (
    None
):
    # Rank 1 was SIGSTOPped after step 2; rank 0 waited in #7 and its 10 s process-group timeout fired.
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    job.error(
        0, end + 10, "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv", step=3
    )
    job.exit(0, end + 10.1, reason="error", step=3)
    incidents = diagnose(job.snapshot(), end + 11)
    assert "rank_crashed" not in kinds(incidents), [i.message for i in incidents]
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [1]
    assert (
        "rank 0 was waiting in all_reduce(SUM) [4] float32 at train.py:57, collective #7 of group default, which rank 1 never issued"
        in (err.message)
    )


def test_a_rank_waiting_on_its_comm_hooks_own_future_is_the_culprit_and_the_hook_is_named() -> None:
    # instrument(ddp, comm_hook=h): on rank 1, h returned a future of its own for bucket 0 and issued nothing.
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    hook = "compress() at train.py:12"
    job.hang(
        1, end + 5, step=3, inflight=[], pending=[{"index": 0, "missing": [], "launched": True, "hook": hook}]
    )
    incidents = diagnose(job.snapshot(), end + 6)
    said = f"waiting for the future of bucket 0 from its comm hook, {hook}, which issued no collective"
    peer = next(i for i in incidents if i.kind == "hang" and i.rank == 0)
    assert peer.culprit_ranks == [1] and said in peer.message, peer.message
    own = next(i for i in incidents if i.kind == "hang" and i.rank == 1)
    assert own.culprit_ranks == [1] and said in own.message, own.message


def test_a_rank_that_reported_its_timeout_twice_is_said_to_wait_once() -> None:
    # instrument() reports a failed bucket all-reduce (non-fatal), then the exception ends the rank (fatal).
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    callback = "Got the following error when running the callback: RuntimeError: "
    timeout = f"{callback}[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"
    job.error(0, end + 10, timeout, step=3, fatal=False)
    job.error(0, end + 10.01, callback + timeout, step=3)  # torch's finalizer wraps it once more
    err = only(diagnose(job.snapshot(), end + 11), "rank_error")
    assert err.culprit_ranks == [1], err.message
    assert err.message.count("rank 0 was waiting in") == 1, err.message


def test_a_process_group_timeout_before_any_hang_report_is_blamed_on_the_rank_that_never_issued_it() -> None:
    # init_process_group(timeout=8 s) under the default 5-minute hang timeout: rank 0 gives up in #7
    # with no hang report of its own; rank 1, alive and beating, had never issued #7.
    job = started(2)
    end = job.train(3)
    job.coll(0, end + 1, 7, site="train.py:57", done=False, step=3)
    job.heartbeat(1, end + 8, step=2, phase="idle", last=6)
    job.error(
        0, end + 9, "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv", step=3
    )
    job.exit(0, end + 9.1, reason="error", step=3)
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert err.culprit_ranks == [1], err.message
    assert (
        "the cause is on rank 1: rank 0 was waiting in all_reduce(SUM) [4] float32 at train.py:57, collective #7 "
        "of group default, which rank 1 never issued" in err.message
    )
    assert "killed by the OS" not in err.message


def late_peer_job(group_timeout_s: float | None = None) -> tuple[JobRecords, float]:
    """init_process_group(timeout=5 s) under a 30 s hang timeout: rank 0 saves a checkpoint for 9 s after
    step 2; rank 1 gives up in #7 after 5 s, and rank 0 enters #7 after that, only to lose its connection.
    With ``group_timeout_s`` the ranks declare their group's timeout and a 30 s hang timeout in
    ``rank_start``. Returns the job and the end of its last step."""
    job = started(2)
    if group_timeout_s is not None:
        for rec in job.records:
            if rec["kind"] == "rank_start":
                rec.update(group_timeout_s=group_timeout_s, hang_timeout_s=30.0)
    end = job.train(3)
    job.coll(1, end + 1, 7, site="train.py:57", done=False, step=3)
    job.error(
        1, end + 6, "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv", step=3
    )
    job.exit(1, end + 6.1, reason="error", step=3)
    job.coll(0, end + 9, 7, site="train.py:57", done=False, step=3)
    job.error(
        0, end + 9.1, "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234", step=3
    )
    job.exit(0, end + 9.2, reason="error", step=3)
    return job, end


def test_a_process_group_timeout_on_a_peer_that_entered_late_is_blamed_on_the_late_rank() -> None:
    # Both ranks issued #7, so none "never issued" it; it once said "no rank reported a cause".
    job, end = late_peer_job()
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert err.culprit_ranks == [0], err.message
    assert (
        "rank 1 was waiting in all_reduce(SUM) [4] float32 at train.py:57, collective #7 of group default, "
        "held up by rank 0, which entered it 8.0 s after rank 1, when rank 1 had given up" in err.message
    )
    assert "no rank reported a cause" not in err.message


def late_peer_timeout(group_timeout_s: float) -> str:
    """``late_peer_job``'s rank_error message, the ranks declaring ``group_timeout_s``."""
    job, end = late_peer_job(group_timeout_s)
    return only(diagnose(job.snapshot(), end + 10), "rank_error").message


def test_a_process_group_timeout_shorter_than_the_hang_timeout_is_named_with_what_to_set() -> None:
    message = late_peer_timeout(5.0)
    assert (
        "No hang report came first: the process group's timeout (5 s) is shorter than DDPSCOPE_HANG_TIMEOUT "
        "(30 s), so torch ended the wait before ddpscope took every thread's stack; set DDPSCOPE_HANG_TIMEOUT "
        "below 5 s on every rank." in message
    )
    assert "No hang report came first" not in late_peer_timeout(1800.0)


def test_different_ops_at_one_number_are_said_to_wait_not_to_give_wrong_results() -> None:
    job = started(2)
    end = job.train(1)
    job.coll(0, end, 3, op="barrier", reduce_op=None, shapes=[], site="train.py:60", done=False)
    job.coll(1, end, 3, op="all_reduce", site="train.py:61", done=False)
    mismatch = only(diagnose(job.snapshot(), end + 1), "mismatch")
    assert "waits until the process group's timeout" in mismatch.message
    assert "results are wrong" not in mismatch.message


def test_a_timeout_is_blamed_on_a_rank_that_was_stuck_at_the_time_even_if_it_moved_on_later() -> None:
    job = started(2)
    end = job.train(3)
    job.coll(0, end, 7, site="train.py:57", step=3, done=False)
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end)])
    stuck_hang(job, 1, end + 5, step=3, phase="forward", line=19)
    job.error(0, end + 10, "[gloo] Timed out waiting 10000ms for recv operation to complete", step=3)
    job.exit(0, end + 10.1, reason="error", step=3)
    job.add("hang_resolved", 1, end + 25, step=3, hang_s=25.0)  # it woke up and entered #7, too late
    job.coll(1, end + 25, 7, site="train.py:57", step=3, done=False)
    job.error(1, end + 25.1, "Connection closed by peer", step=3)
    incidents = diagnose(job.snapshot(), end + 26)
    err = only(incidents, "rank_error")
    assert (
        err.culprit_ranks == [1]
        and "rank 1 was stuck in forward at step 3 at /proj/data.py:19" in err.message
    )
    hang0 = next(i for i in incidents if i.kind == "hang" and i.rank == 0)
    assert hang0.active and hang0.message.startswith("(ended when the rank died)")
    assert hang0.culprit_ranks == [1] and "entered collective #7 25 s late" in hang0.message


def test_a_rank_killed_while_it_hung_no_longer_hangs_and_its_hang_explains_the_failure() -> None:
    job = started(2)
    end = job.train(3)
    stuck_hang(job, 1, end + 5, step=3, phase="idle")
    job.coll(0, end, 7, site="train.py:57", step=3, done=False)
    job.hang(0, end + 5, step=3, inflight=[inflight(7, end)])
    job.error(0, end + 8, "Connection reset by peer", step=3)  # rank 1 was SIGKILLed at end + 8
    snap = job.snapshot()
    live = liveness(snap, end + 9)
    assert live.crashed == [1] and live.active_hangs == {} and live.status == "failed"
    hang1 = next(i for i in diagnose(snap, end + 9) if i.kind == "hang" and i.rank == 1)
    assert hang1.message.startswith("(ended when the rank died)") and hang1.culprit_ranks == [1]


def evaluating(job: JobRecords, rank: int, t: float, *, step: int) -> None:
    """A rank evaluating on ``model.module`` under no_grad: its watchdog sees no progress, nothing in
    flight, the main thread in user code."""
    stuck_hang(job, rank, t, step=step, phase="idle", line=40)


def test_every_rank_busy_in_its_own_code_with_no_collective_in_flight_is_not_a_hang() -> None:
    job = started(2)
    end = job.train(3)
    for r in range(2):
        evaluating(job, r, end + 5, step=2)
        job.heartbeat(r, end + 9, step=2, phase="idle", last=6)
    snap = job.snapshot()
    live = liveness(snap, end + 9.5)
    assert live.status == "running" and live.active_hangs == {}
    assert "hang" not in kinds(diagnose(snap, end + 9.5))
    # The evaluation ends on both ranks and training goes on: still nothing to report.
    for r in range(2):
        job.add("hang_resolved", r, end + 12, step=3, hang_s=12.0)
    end2 = job.train(2, t=end + 12)
    assert diagnose(job.snapshot(), end2) == [] and job_status(job.snapshot(), end2) == "running"


def test_a_rank_busy_in_its_own_code_becomes_the_culprit_once_a_peer_reports_waiting_for_it() -> None:
    job = started(2)
    end = job.train(3)
    evaluating(job, 1, end + 5, step=2)  # rank 1 still evaluates; rank 0 went on to the next step
    assert job_status(job.snapshot(), end + 6) == "running"
    waiting_in(job, 0, end + 10, 7, step=3)
    snap = job.snapshot()
    assert job_status(snap, end + 10.5) == "hung" and sorted(liveness(snap, end + 10.5).active_hangs) == [
        0,
        1,
    ]
    hangs = {i.rank: i for i in diagnose(snap, end + 10.5) if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1] and hangs[1].culprit_ranks == [1]


def test_a_checkpoint_on_one_rank_that_held_up_its_peer_stays_its_culprit_after_it_ended() -> None:
    job = started(2)
    end = job.train(3)
    stuck_hang(job, 0, end + 5, step=2, phase="idle")  # rank 0 writes a checkpoint for 12 s
    job.coll(1, end, 7, op="barrier", reduce_op=None, site="train.py:67", step=2, done=False)
    job.hang(1, end + 5, step=2, phase="idle", inflight=[inflight(7, end, "train.py:67")])
    job.coll(0, end + 12, 7, op="barrier", reduce_op=None, site="train.py:67", step=2)
    job.add("hang_resolved", 0, end + 12.1, step=3, hang_s=12.0)
    job.add("hang_resolved", 1, end + 12.1, step=3, hang_s=12.0)
    end2 = job.train(1, t=end + 12.2)
    snap = job.snapshot()
    assert job_status(snap, end2) == "running"
    hangs = {i.rank: i for i in diagnose(snap, end2) if i.kind == "hang"}
    assert not hangs[0].active and hangs[0].culprit_ranks == [0]
    assert (
        "it was stuck in its own code, outside any collective, while rank 1 waited for it" in hangs[0].message
    )
    assert hangs[0].call_site == "/proj/data.py:12"


def _clock_sync(job: JobRecords, rank: int, t: float, op: str, pair: str, *, done: bool) -> None:
    job.coll(rank, t, 1, op=op, reduce_op=None, shapes=[[2]], dtypes=["int64"], pg=pair, site="train.py:30",
             done=done, source="engine")  # fmt: skip


def test_a_peer_that_entered_late_because_it_waited_for_another_rank_itself_passes_the_blame_on() -> None:
    # No rank_start yet: all three wait in the engine's start-up clock sync. Rank 0 serves rank 1 first,
    # which spent 12 s loading; rank 2 waits for rank 0 meanwhile. Everything resolves afterwards.
    job = JobRecords(3)
    _clock_sync(job, 2, T0, "send", "default:p2p:0-2", done=False)
    _clock_sync(job, 0, T0, "recv", "default:p2p:0-1", done=False)
    job.hang(0, T0 + 3, step=0, phase="idle", inflight=[inflight(1, T0, pg="default:p2p:0-1")])
    job.hang(2, T0 + 3, step=0, phase="idle", inflight=[inflight(1, T0, pg="default:p2p:0-2")])
    _clock_sync(job, 1, T0 + 12, "send", "default:p2p:0-1", done=True)
    _clock_sync(job, 0, T0 + 12.1, "recv", "default:p2p:0-2", done=True)
    for r in (0, 2):
        job.add("hang_resolved", r, T0 + 12.2, step=0, hang_s=12.2)
    hangs = {i.rank: i for i in diagnose(job.snapshot(), T0 + 13) if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1] and "entered collective #1 12 s late" in hangs[0].message
    assert hangs[2].culprit_ranks == [1], hangs[2].message
    assert "holding up rank 0 in ddpscope's start-up clock sync (recv [2] int64)" in hangs[2].message
    assert "so that rank 0 entered collective #1 12 s late" in hangs[2].message


def test_the_world_size_comes_from_heartbeats_or_named_ranks_when_no_rank_built_its_model() -> None:
    # No rank_start: rank 1 failed during its set-up, before its DDP model existed.
    job = JobRecords(0)
    job.add("heartbeat", 0, T0, phase="idle", step=0, last_coll_seq=0, pid=1000, world_size=4)
    assert job.snapshot().world_size == 4
    older = JobRecords(0)  # an agent whose heartbeats carry no world size: the ranks its peers wait for
    older.heartbeat(0, T0, phase="idle")
    older.coll(0, T0, 1, op="recv", pg="default:p2p:0-2", done=False)
    assert older.snapshot().world_size == 3


def test_a_rank_that_never_reported_is_named_from_the_pair_its_peer_waits_in() -> None:
    # Rank 0 is stuck before anything is measured (creating process groups in another order than its
    # peers): the collector knows it only from the name of the pair rank 2 sends to.
    job = JobRecords(3)
    _clock_sync(job, 2, T0, "send", "default:p2p:0-2", done=False)
    job.hang(2, T0 + 3, step=0, phase="idle", inflight=[inflight(1, T0, pg="default:p2p:0-2")])
    for r in (1, 2):
        job.heartbeat(r, T0 + 4, phase="idle")  # rank 1 is alive elsewhere
    incidents = diagnose(job.snapshot(), T0 + 5)
    hang = only(incidents, "hang")
    assert hang.culprit_ranks == [0], hang.message
    assert "never issued collective #1 of group default:p2p:0-2; it has never reported" in hang.message
    assert "inside the backend" not in hang.message


def test_a_peer_stuck_in_its_own_code_is_quoted_from_the_stall_that_held_this_rank_up_not_a_later_one() -> (
    None
):
    # Rank 1 evaluates alone after step 2 while rank 0 waits for it; it evaluates again after its last
    # step, when nobody waits.
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    stuck_hang(job, 1, end + 4, step=2, phase="idle", line=12)
    job.add("hang_resolved", 1, end + 8, step=2, hang_s=8.0)
    job.add("hang_resolved", 0, end + 8, step=3, hang_s=8.0)
    job.coll(1, end + 8, 7, site="train.py:57", step=3)
    later = job.train(2, t=end + 9, first=4)
    stuck_hang(job, 1, later + 4, step=5, phase="idle", line=99)
    hang = next(i for i in diagnose(job.snapshot(), later + 5) if i.kind == "hang" and i.rank == 0)
    assert "stuck between steps after step 2 at /proj/data.py:12" in hang.message, hang.message
    assert "data.py:99" not in hang.message


def test_the_users_own_folder_named_ddp_is_user_code_and_ddpscopes_engine_is_not() -> None:
    from ddpscope.server.analysis.incident_model import user_frame

    def tb(*paths: str) -> str:
        return "Traceback (most recent call last):\n" + "".join(
            f'  File "{p}", line 7, in f\n' for p in paths
        )

    engine = "/repo/ddpscope/ddp/engine.py"  # an editable install keeps the engine in ddp/
    assert user_frame(tb("/proj/ddp/train.py", engine)) == "/proj/ddp/train.py:7"
    assert (
        user_frame(tb("/proj/agent/loop.py", "/usr/lib/python3.11/threading.py")) == "/proj/agent/loop.py:7"
    )


def test_a_rank_whose_loop_ended_early_and_lingered_past_its_peers_timeout_is_still_an_early_exit() -> None:
    # Rank 1 has fewer batches: after step 2 it leaves its loop and post-processes for 28 s, while
    # ranks 0 and 2 wait in step 3's all-reduce until their 20 s timeout; then it exits cleanly.
    job = started(3)
    end = job.train(3)  # steps 0..2
    for r in (0, 2):
        waiting_in(job, r, end + 3, 7, step=3)
        job.error(r, end + 20, "Timed out waiting 20000ms for recv operation to complete", step=3)
    job.exit(1, end + 28, step=2)
    incidents = diagnose(job.snapshot(), end + 29)
    early = only(incidents, "rank_exited_early")
    assert early.culprit_ranks == [1], early.message
    assert "exited normally after step 2 while ranks 0, 2 were still training" in early.message
    assert "ranks 0, 2 timed out waiting for it" in early.message and "uneven data" in early.message


def test_a_rank_that_trained_one_step_through_model_module_ran_out_of_batches_first_and_is_told_why() -> None:
    # Rank 1's step after step 1 went through model.module: no DDP step, nothing all-reduced. It runs out of
    # batches one sync early and exits while rank 0 waits in step 3's all-reduce.
    job = started(2)
    end = job.train(3)  # steps 0..2
    job.add("warning", 1, end - 0.15, step=1, code="unsynced_gradients", message="the backward() at train.py:9 ...",
            parameters=["head.bias"], call_site="train.py:9")  # fmt: skip
    waiting_in(job, 0, end + 0.1, 7, step=3)
    job.exit(1, end + 0.05, step=2)
    job.error(0, end + 0.2, "Connection closed by peer [127.0.0.1]:4312", step=3)
    early = only(diagnose(job.snapshot(), end + 1), "rank_exited_early")
    assert early.culprit_ranks == [1], early.message
    assert (
        "Its backward() at train.py:9 after step 1 gave the model gradients that no forward" in early.message
    )
    assert "ran out of batches a gradient sync before its peers" in early.message
    assert "uneven data" not in early.message


def test_a_rank_that_skipped_one_backward_ran_out_of_batches_first_and_is_the_early_exit() -> None:
    # Rank 1 skipped the backward of step 5 (a bad batch, `continue` before backward()): from then on its
    # step s+1 syncs with rank 0's step s, it finishes its 12 forwards one sync early and exits cleanly,
    # and rank 0, in its 12th sync, loses the connection. Rank 1 numbers its steps *ahead* of rank 0.
    job = started(2)
    end = job.train(5)  # steps 0..4, syncs #1..#10
    t = end
    for k in range(6):  # six more syncs each: rank 0's steps 5..10, rank 1's steps 6..11
        for r, step in ((0, 5 + k), (1, 6 + k)):
            seqs = [11 + 2 * k, 12 + 2 * k]
            for seq in seqs:
                job.coll(r, t, seq, site="ddp/reducer.py:88", step=step, source="engine")
            job.step(r, t, step, seqs=seqs)
        t += 0.1
    job.coll(0, t, 23, site="ddp/reducer.py:88", step=11, source="engine", done=False)
    job.exit(1, t + 0.01, step=11)
    job.error(0, t + 0.03, "Connection closed by peer [127.0.0.1]:4312", step=11)
    job.exit(0, t + 0.04, reason="error", step=11)
    incidents = diagnose(job.snapshot(), t + 1)
    early = only(incidents, "rank_exited_early")
    assert early.culprit_ranks == [1], early.message
    assert "It ran 1 more forward pass without a backward than rank 0" in early.message
    assert "its steps 0 to 11 had 11 backward passes" in early.message
    assert "ran out of batches 1 gradient sync before its peers" in early.message
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [1] and "killed by the OS" not in err.message, err.message


def test_a_rendezvous_that_timed_out_blames_the_ranks_that_never_joined_it() -> None:
    # Rank 0 hosts the store; ranks 2 and 3 never started. Rank 1, which joined, waits as rank 0 does.
    job = JobRecords(4)
    job.error(0, T0 + 26, "Timed out after 26 seconds waiting for clients. 2/4 clients joined.", step=None)
    job.error(1, T0 + 26.1, "Socket Timeout", step=None)
    err = next(i for i in diagnose(job.snapshot(), T0 + 27) if i.kind == "rank_error" and i.rank == 0)
    assert err.culprit_ranks == [2, 3], err.message
    assert "rendezvous timed out with 2 of 4 ranks joined" in err.message


def test_a_rank_that_never_reached_the_rendezvous_store_blames_rank_0_when_it_never_reported() -> None:
    job = JobRecords(2)
    message = "The client socket has timed out after 25000ms while trying to connect to (10.0.0.7, 29500)."
    job.error(1, T0 + 25, message, step=None, fatal=False)  # said by the wrapper as it happens
    job.error(1, T0 + 25.1, message, step=None)  # uncaught: said again as the process ends
    job.exit(1, T0 + 25.2, reason="error", step=None)
    incidents = diagnose(job.snapshot(), T0 + 200)
    err = only(incidents, "rank_error")
    assert err.culprit_ranks == [0], err.message
    assert "could not reach the rendezvous store at 10.0.0.7:29500" in err.message
    # Rank 0 was never heard of and rank 1 died of the error: the job failed, it did not fall silent.
    assert "job_silent" not in kinds(incidents) and job_status(job.snapshot(), T0 + 200) == "failed"


def test_a_rank_lost_before_it_ever_reported_is_said_to_have_ended_in_its_set_up_however_it_did() -> None:
    # SIGKILLed while building its model: its peers lose the connection in the engine's clock sync.
    job = JobRecords(3)
    for r in (0, 2):
        job.heartbeat(r, T0, phase="idle")
        job.error(r, T0 + 1, "Connection reset by peer", step=None)
    crashed = only(diagnose(job.snapshot(), T0 + 2), "rank_crashed")
    assert crashed.culprit_ranks == [1]
    assert (
        "Rank 1 never reported anything, and ranks 0, 2 then lost their connections to it" in crashed.message
    )
    # Nothing says how it ended: an exception or an exit during set-up is as likely as a kill.
    assert "it ended during its set-up, before ddpscope watched it" in crashed.message
    assert "raised an exception" in crashed.message and "its log and exit status say which" in crashed.message
    assert "check the host's kernel log" not in crashed.message


def _tagged(job: JobRecords, rank: int, t: float, op: str, tag: int, seq: int = 1) -> None:
    """A user's blocking send or recv on the pair (0, 1), with ``tag`` (0: left out, as the agent does)."""
    job.coll(
        rank, t, seq, op=op, reduce_op=None, pg="default:p2p:0-1", site=f"pipe.py:{10 + rank}", done=False
    )
    if tag:
        job.records[-1]["tag"] = tag


def test_a_send_and_a_receive_waiting_with_different_tags_are_both_named_with_the_tags() -> None:
    job = started(2)
    _tagged(job, 0, T0 + 1, "send", 1)
    _tagged(job, 1, T0 + 1, "recv", 2)
    for r in (0, 1):
        job.hang(r, T0 + 6, step=0, phase="idle", inflight=[inflight(1, T0 + 1, pg="default:p2p:0-1")])
    hangs = {i.rank: i for i in diagnose(job.snapshot(), T0 + 7) if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [0, 1] and hangs[1].culprit_ranks == [0, 1]
    assert "send(tag=1) [4] float32 at pipe.py:10" in hangs[0].message
    assert "the tags differ: rank 0's send carries tag 1, and rank 1 waits in recv(tag=2)" in hangs[0].message
    assert "pass the same tag to the send and its receive" in hangs[1].message
    assert "every rank issued this collective in time" not in hangs[0].message


def test_tagged_transfers_the_peer_also_waits_in_with_the_same_tag_are_not_called_a_tag_mismatch() -> None:
    # Two transfers in flight, received in the other order on purpose: the peer's later receive takes
    # this send's tag, so the tags at one sequence number differ without being the cause.
    job = started(2)
    _tagged(job, 0, T0 + 1, "send", 1)
    _tagged(job, 1, T0 + 1, "recv", 2)
    _tagged(job, 1, T0 + 1, "recv", 1, seq=2)
    for r in (0, 1):
        job.hang(r, T0 + 6, step=0, phase="idle", inflight=[inflight(1, T0 + 1, pg="default:p2p:0-1")])
    hang = next(i for i in diagnose(job.snapshot(), T0 + 7) if i.kind == "hang" and i.rank == 0)
    assert "the tags differ" not in hang.message


def test_ranks_that_timed_out_in_a_send_and_a_receive_of_different_tags_are_told_so_without_a_hang_report() -> (
    None
):
    # The group's timeout came before the hang timeout: only the failed ends and the errors say it.
    job = started(2)
    _tagged(job, 0, T0 + 1, "send", 1)
    _tagged(job, 1, T0 + 1, "recv", 0)
    for r, op in ((0, "send"), (1, "recv")):
        job.add(
            "collective_end",
            r,
            T0 + 16,
            pg="default:p2p:0-1",
            coll_seq=1,
            end_ns=int((T0 + 16) * 1e9),
            ok=False,
        )
        job.error(r, T0 + 16, f"Timed out waiting 15000ms for {op} operation to complete", step=0)
    error = only(diagnose(job.snapshot(), T0 + 17), "rank_error")
    assert error.culprit_ranks == [0, 1]
    assert "the cause is on ranks 0, 1: the tags differ" in error.message
    assert (
        "rank 0's send carries tag 1, and rank 1 waits in recv [4] float32 at pipe.py:11 (tag 0)"
        in error.message
    )


def test_a_rank_that_exits_without_the_call_its_peer_makes_after_training_is_named_with_that_call() -> None:
    # Rank 1 destroys its group and exits after the last step; rank 0 all-reduces a final metric.
    job = started(2)
    end = job.train(5)  # steps 0..4, collectives 1..10
    job.exit(1, end + 0.5, step=4)
    job.coll(0, end + 0.2, 11, site="eval.py:30", done=False, step=None)
    job.error(0, end + 0.6, "Connection closed by peer [127.0.0.1]:22453", step=4)
    early = only(diagnose(job.snapshot(), end + 1), "rank_exited_early")
    assert early.culprit_ranks == [1]
    assert early.message.startswith(
        "Rank 1 exited normally after step 4 without making all_reduce(SUM) [4] float32 at eval.py:30 "
        "(collective #11 of group default), a call after training that rank 0 waited in"
    )
    assert "destroy the process group only after the last one" in early.message
    assert "still training" not in early.message


AT_EXIT = '  File "/usr/lib/python3.11/threading.py", line 1590, in _shutdown\n    lock.acquire()\n'


def test_a_rank_that_cannot_exit_for_a_non_daemon_thread_is_a_hang_though_no_peer_waits_for_it() -> None:
    job = started(2)
    end = job.train(5)
    job.exit(0, end + 0.5, step=4)
    stacks = [
        {"thread": "MainThread", "stack": AT_EXIT},
        {"thread": "pusher", "daemon": False, "stack": '  File "/proj/metrics.py", line 12, in push\n'},
        {"thread": "loader", "daemon": True, "stack": '  File "/proj/data.py", line 3, in prefetch\n'},
        {
            "thread": "ddpscope-agent",
            "daemon": False,
            "stack": '  File "/x/agent/worker.py", line 1, in run\n',
        },
    ]
    job.add("hang", 1, end + 6, phase="idle", step=4, stalled_s=5.0, pending_buckets=[], inflight=[],
            stacks=stacks, message="cannot exit", main_cpu_s=0.0)  # fmt: skip
    snap = job.snapshot()
    assert job_status(snap, end + 7) == "hung"
    incidents = diagnose(snap, end + 7)
    assert kinds(incidents) == ["hang"]  # rank 0 exited after finishing too: no early exit
    hang = only(incidents, "hang")
    assert hang.culprit_ranks == [1] and hang.active
    assert hang.message.startswith(
        "Rank 1 finished its script but cannot exit: its main thread has waited 6 s in Python's shutdown for "
        "thread 'pusher' (at /proj/metrics.py:12), which never ended."
    )
    assert "daemon=True" in hang.message


def test_a_rank_whose_exit_handler_never_returns_is_a_hang_with_the_handlers_line() -> None:
    job = started(2)
    end = job.train(5)
    job.exit(0, end + 0.5, step=4)
    stacks = [
        {
            "thread": "MainThread",
            "stack": '  File "/proj/train.py", line 30, in upload_final\n    time.sleep(3600)\n',
        }
    ]
    job.add("hang", 1, end + 6, phase="idle", step=4, stalled_s=5.0, pending_buckets=[], inflight=[],
            stacks=stacks, message="cannot exit", main_cpu_s=0.0, exiting=True)  # fmt: skip
    incidents = diagnose(job.snapshot(), end + 7)
    hang = only(incidents, "hang")
    assert kinds(incidents) == ["hang"] and hang.culprit_ranks == [1]
    assert (
        "its main thread has run an exit handler for 6 s that never returned at /proj/train.py:30"
        in hang.message
    )
    assert "give it a timeout, or do that work before the script ends" in hang.message


def test_a_stall_at_a_line_where_the_rank_stalled_and_went_on_before_is_named_a_routine_phase() -> None:
    # Rank 0 evaluates alone each epoch for 7 s while rank 1 waits in a barrier; the timeout is 5 s.
    job = started(2)
    end = job.train(3)
    for epoch, t in enumerate((end + 5, end + 30)):
        waiting_in(job, 1, t, 7 + epoch, step=2 + epoch)
        stuck_hang(job, 0, t, step=2 + epoch, phase="idle", cpu_s=4.5)
        if epoch == 0:
            for r in (0, 1):
                job.add("hang_resolved", r, t + 2, step=2, hang_s=7.0)
    hangs = [i for i in diagnose(job.snapshot(), end + 31) if i.kind == "hang" and i.rank == 0]
    first, second = sorted(hangs, key=lambda i: i.time_s or 0)
    assert "routine phase" not in first.message
    assert (
        "it stalled at this line once before and went on after 7 s: a routine phase of this rank alone"
        in (second.message)
    )
    assert "Set DDPSCOPE_HANG_TIMEOUT above its length" in second.message and second.culprit_ranks == [0]


def test_a_rank_training_on_a_thread_of_its_own_is_placed_at_that_threads_line_not_the_main_threads_join() -> (
    None
):
    job = started(2)
    end = job.train(3)
    waiting_in(job, 0, end + 5, 7, step=3)
    join = (
        '  File "/proj/launch.py", line 30, in <module>\n'
        '  File "/usr/lib/python3.11/threading.py", line 1119, in join\n'
    )
    trainer = '  File "/usr/lib/python3.11/threading.py", line 982, in run\n  File "/proj/data.py", line 12, in next_batch\n'
    job.add("hang", 1, end + 5, phase="idle", step=2, stalled_s=5.0, pending_buckets=[], inflight=[],
            stacks=[{"thread": "MainThread", "stack": join}, {"thread": "trainer", "stack": trainer}],
            message="no progress", main_cpu_s=0.0, thread="trainer")  # fmt: skip
    hangs = {i.rank: i for i in diagnose(job.snapshot(), end + 6) if i.kind == "hang"}
    assert hangs[1].call_site == "/proj/data.py:12" and hangs[0].culprit_ranks == [1]
    assert "training thread 'trainer' at /proj/data.py:12" in hangs[1].message
    assert (hangs[1].stack or "").startswith("Thread trainer:")
    assert "stuck between steps after step 2 at /proj/data.py:12" in hangs[0].message


PDB_STACK = (
    '  File "/proj/train.py", line 11, in <module>\n    time.sleep(0.02)\n'
    '  File "/usr/lib/python3.11/bdb.py", line 90, in trace_dispatch\n'
    '  File "/usr/lib/python3.11/bdb.py", line 115, in dispatch_line\n'
    '  File "/usr/lib/python3.11/pdb.py", line 433, in interaction\n    self._cmdloop()\n'
    '  File "/usr/lib/python3.11/pdb.py", line 397, in _cmdloop\n    self.cmdloop()\n'
    '  File "/usr/lib/python3.11/cmd.py", line 126, in cmdloop\n    line = input(self.prompt)\n'
)
"""torch 2.13 / Python 3.11: a breakpoint() on rank 0 only, its standard input a pipe nobody writes to."""
DEBUGPY_STACK = (
    '  File "/proj/train.py", line 5, in <module>\n    debugpy.wait_for_client()\n'
    '  File "/venv/lib/python3.11/site-packages/debugpy/public_api.py", line 31, in wait_for_client\n'
    '  File "/venv/lib/python3.11/site-packages/debugpy/server/api.py", line 300, in wait_for_client\n'
    '  File "/usr/lib/python3.11/threading.py", line 629, in wait\n'
)


@pytest.mark.parametrize(
    ("stack", "said"),
    [
        (
            PDB_STACK,
            "stopped at a debugger's prompt (pdb), waiting for someone to type at its standard input",
        ),
        (
            PDB_STACK.replace(
                "/usr/lib/python3.11/pdb.py", "/venv/lib/python3.11/site-packages/pudb/debugger.py"
            ),
            "stopped at a debugger's prompt (pudb)",
        ),
        (DEBUGPY_STACK, "waiting for a debugger to attach (debugpy.wait_for_client()), which none has"),
    ],
)
def test_a_rank_sitting_in_a_debugger_is_said_to_wait_for_a_person_not_just_blocked(
    stack: str, said: str
) -> None:
    hangs = hangs_of_a_rank_stuck_at(stack, stuck=0)
    assert hangs[1].culprit_ranks == [0] and said in hangs[1].message, hangs[1].message
    assert said in hangs[0].message and "using no CPU" not in hangs[0].message, hangs[0].message


def test_ranks_wrapping_the_model_in_different_ddp_classes_are_told_so_not_only_who_never_issued_what() -> (
    None
):
    # torch 2.13: rank 0 builds ddpscope's DistributedDataParallel (its start-up clock sync waits for rank 1),
    # rank 1 torch's (blocked in its parameter-shape check); neither constructor finishes.
    job = started(2)
    engine = (
        '  File "/proj/train.py", line 9, in <module>\n    model = DistributedDataParallel(net)\n'
        '  File "/venv/lib/python3.11/site-packages/ddpscope/ddp/engine.py", line 250, in __init__\n'
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2799, in recv\n'
    )
    torch_ddp = (
        '  File "/proj/train.py", line 10, in <module>\n    model = instrument(TorchDDP(net))\n'
        '  File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1064, in __init__\n'
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/utils.py", line 286, in '
        "_verify_param_shape_across_processes\n"
    )
    job.coll(0, T0 + 1, 1, op="recv", reduce_op=None, shapes=[[2]], dtypes=["int64"], site=None,
             pg="default:p2p:0-1", done=False, source="engine")  # fmt: skip
    job.add("hang", 0, T0 + 6, phase="idle", step=0, stalled_s=5.0, pending_buckets=[],
            inflight=[inflight(1, T0 + 1, site="", pg="default:p2p:0-1")],
            stacks=[{"thread": "MainThread", "stack": engine}], message="no progress", main_cpu_s=0.0)  # fmt: skip
    stuck_hang(job, 1, T0 + 6.5, step=0, phase="idle", cpu_s=0.0, stack=torch_ddp)
    hangs = {i.rank: i for i in diagnose(job.snapshot(), T0 + 7) if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1]
    assert (
        "it is inside the constructor of torch's DistributedDataParallel while rank 0 is inside that of "
        "ddpscope's DistributedDataParallel: the ranks wrap the model with different classes"
        in hangs[0].message
    ), hangs[0].message
    # The rank in torch's constructor is told the same from its own side, and where it waits.
    assert hangs[1].culprit_ranks == [1]
    assert (
        "in torch's DistributedDataParallel construction (_verify_param_shape_across_processes)"
        in hangs[1].message
        and "it is inside the constructor of torch's DistributedDataParallel while rank 0 is inside that of "
        "ddpscope's DistributedDataParallel"
        in hangs[1].message
    ), hangs[1].message
