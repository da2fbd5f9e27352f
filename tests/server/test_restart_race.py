"""A job restarted in place (torchrun ``--max-restarts``) whose new processes fail or stall while their
process group connects, before any of them reaches its DDP model (so before any new ``rank_start``):
the new attempt is what the job's status and incidents rest on, the earlier one is history, and a
connection to an address the earlier attempt used is named as the rendezvous store's leftover
(synthetic records shaped as torch 2.13 on gloo wrote them in ``server/analysis/restart_race.py``'s runs)."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import job_status
from tests.server.test_incidents import JobRecords, kinds, started
from tests.server.test_unrecorded_waits import TORCH, blocked_in

STALE = (
    "Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out "
    "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:{port}$0"
)
IN_GROUP_CONSTRUCTION = (
    '  File "/proj/train.py", line 12, in <module>\n'
    f'  File "{TORCH}/distributed/distributed_c10d.py", line 1899, in init_process_group\n'
    f'  File "{TORCH}/distributed/distributed_c10d.py", line 2169, in _new_process_group_helper\n'
)


def crashed_first_attempt() -> tuple[JobRecords, float]:
    """Rank 1 raised after step 4; rank 0 lost its connection to rank 1's gloo address 127.0.0.1:435;
    both exited. Then torchrun started both again: new agent streams, nothing sent yet."""
    job = started(2)
    end = job.train(5)
    job.error(1, end, "simulated ECC error", step=4)
    job.error(0, end + 0.5, "[pair.cc:553] Connection closed by peer [127.0.0.1]:435. This is typically caused "
              "by a remote worker crashing.", step=5)  # fmt: skip
    job.exit(1, end + 0.1, reason="error")
    job.exit(0, end + 0.6, reason="error")
    for r in (0, 1):
        job._incarnation[r] = 2
    return job, end + 2


def test_a_restart_failing_on_an_address_of_the_earlier_attempt_is_the_current_failure_and_names_the_store() -> (
    None
):
    job, t = crashed_first_attempt()
    for r in (0, 1):
        job.error(r, t + r * 0.01, STALE.format(port=435), step=None)
        job.exit(r, t + 0.1 + r * 0.01, reason="error", step=None)
    incidents = diagnose(job.snapshot(), t + 1)
    history = [i for i in incidents if not i.active]
    current = [i for i in incidents if i.active]
    assert [(i.kind, i.culprit_ranks) for i in history] == [("rank_error", [1])]
    assert "simulated ECC error" in history[0].message
    assert history[0].message.startswith("Before the ranks restarted (2 s before it)")
    assert kinds(current) == ["rank_error"], [i.message for i in current]
    assert (
        "tried to connect to 127.0.0.1:435, an address of the earlier attempt's processes"
        in current[0].message
    )
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in current[0].message
    assert job_status(job.snapshot(), t + 1) == "failed"


def test_a_restart_failing_to_connect_to_an_address_nobody_used_before_keeps_the_plain_cause() -> None:
    job, t = crashed_first_attempt()
    for r in (0, 1):
        job.error(r, t + r * 0.01, STALE.format(port=5555), step=None)
    current = [i for i in diagnose(job.snapshot(), t + 1) if i.active]
    assert kinds(current) == ["rank_error"]
    assert "earlier attempt" not in current[0].message


def test_a_restart_stalled_while_its_group_connects_is_told_as_the_store_s_leftover() -> None:
    job, t = crashed_first_attempt()
    for r in (0, 1):
        blocked_in(job, r, t + 60, IN_GROUP_CONSTRUCTION, step=0)
    hangs = [i for i in diagnose(job.snapshot(), t + 61) if i.kind == "hang"]
    assert len(hangs) == 2 and all(i.active for i in hangs)
    assert all("this process is a restart of its rank" in i.message for i in hangs)
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in i.message for i in hangs)


def test_a_first_attempt_stalled_while_its_group_connects_says_nothing_of_restarts() -> None:
    job = JobRecords(2)
    for r in (0, 1):
        blocked_in(job, r, 1_700_000_005.0, IN_GROUP_CONSTRUCTION, step=0)
    hangs = [i for i in diagnose(job.snapshot(), 1_700_000_006.0) if i.kind == "hang"]
    assert hangs and not any("restart" in i.message for i in hangs)


def test_a_crash_report_the_shipper_sends_after_the_exit_is_the_same_process_not_a_restart() -> None:
    job = started(2)
    end = job.train(5)
    job.exit(1, end, reason="error")
    # The shipper turns a faulthandler dump into a rank_error on the process's derived stream.
    rec = {"kind": "rank_error", "job": job.job, "rank": 1, "stream": "s1.1.crash", "seq": 0,
           "time_ns": int((end + 0.5) * 1e9), "step": 5, "phase": "idle", "error_type": "SIGABRT",
           "message": "Fatal Python error: Aborted", "stack": "Fatal Python error: Aborted", "fatal": True}  # fmt: skip
    job.records.append(rec)
    incidents = diagnose(job.snapshot(), end + 1)
    assert not any(i.message.startswith("Before the ranks restarted") for i in incidents), incidents


def test_a_rerun_that_fails_in_set_up_again_is_told_apart_from_the_run_before_though_neither_started() -> (
    None
):
    # Both runs died before any rank built its model (no rank_start at all): the second's records were
    # filed with the first's, and its hang read as lasting through both.
    job = JobRecords(2)
    t = 1_700_000_000.0
    for r in (0, 1):
        job.error(r, t + 1, f"first run's error on rank {r}", step=None)
        job.exit(r, t + 1.1, reason="error", step=None)
        job._incarnation[r] = 2
    for r in (0, 1):
        job.error(r, t + 60, f"second run's error on rank {r}", step=None)
    incidents = diagnose(job.snapshot(), t + 61)
    current = [i for i in incidents if i.active]
    history = [i for i in incidents if not i.active]
    assert current and all("second run" in i.message and "first run" not in i.message for i in current)
    assert history and all(i.message.startswith("Before the ranks restarted") for i in history)
