"""Hangs in collectives ddpscope does not record: a rank's main thread blocked in torch's C++ all-reduce
of a model it does not observe (a GAN's discriminator left as plain torch DDP), read from the stack
in its hang report, against the ranks that are somewhere else meanwhile (synthetic snapshots)."""

from __future__ import annotations

import pytest

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.native_wait import native_wait
from ddpscope.server.analysis.status import job_status, liveness
from tests.server.test_hang_diagnosis import stuck_hang
from tests.server.test_incidents import T0, JobRecords, inflight, kinds, only, started

TORCH = "/venv/lib/python3.11/site-packages/torch"
IN_BACKWARD = (
    '  File "/proj/gan.py", line 40, in <module>\n'
    '  File "/proj/gan.py", line 27, in train_discriminator\n'
    f'  File "{TORCH}/_tensor.py", line 623, in backward\n'
    f'  File "{TORCH}/autograd/__init__.py", line 395, in backward\n'
    f'  File "{TORCH}/autograd/graph.py", line 979, in _engine_run_backward\n'
)
"""Where a rank waits for the plain model's gradient all-reduce: torch's Reducer blocks in C++."""


def blocked_in(
    job: JobRecords,
    rank: int,
    t: float,
    stack: str = IN_BACKWARD,
    *,
    step: int = 3,
    cpu_s: float | None = 0.0,
) -> None:
    """A hang report with nothing in flight whose main thread sits at ``stack``, having used ``cpu_s``
    of CPU (None: a platform that cannot tell)."""
    stacks = [
        {"thread": "ddpscope-watchdog", "stack": '  File "/work/ddp/watchdog.py", line 40, in _run\n'},
        {"thread": "MainThread", "stack": stack},
    ]
    extra = {"main_cpu_s": cpu_s, "message": f"rank {rank} has made no progress for 5.0 s"}
    job.add("hang", rank, t, phase="after_forward", step=step, stalled_s=5.0, pending_buckets=[], inflight=[],
            stacks=stacks, **extra)  # fmt: skip


def hangs_by_rank(job: JobRecords, now: float) -> dict[int, object]:
    return {i.rank: i for i in diagnose(job.snapshot(), now) if i.kind == "hang"}


def test_a_rank_blocked_in_torchs_backward_waits_for_the_peer_stuck_in_its_own_code_and_both_are_hangs() -> (
    None
):
    job = started(2)
    end = job.train(3)
    blocked_in(job, 0, end + 5)
    stuck_hang(job, 1, end + 5, step=3, phase="after_forward", line=19)
    snap = job.snapshot()
    assert job_status(snap, end + 6) == "hung" and sorted(liveness(snap, end + 6).active_hangs) == [0, 1]
    incidents = diagnose(snap, end + 6)
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1] and hangs[0].call_site == "/proj/gan.py:27"
    assert "in torch's backward pass at step 3" in hangs[0].message
    assert "a collective ddpscope does not record" in hangs[0].message
    assert "rank 1 (stuck between forward and backward at step 3 at /proj/data.py:19" in hangs[0].message
    assert hangs[1].culprit_ranks == [1]
    assert "outside any collective, while rank 0 waits for it" in hangs[1].message


@pytest.mark.parametrize(
    ("innermost", "place"),
    [
        (
            f'  File "{TORCH}/nn/parallel/distributed.py", line 2236, in _distributed_broadcast_coalesced\n',
            "torch's DistributedDataParallel (_distributed_broadcast_coalesced)",
        ),
        (
            f'  File "{TORCH}/distributed/utils.py", line 316, in _sync_params_and_buffers\n',
            "DistributedDataParallel's state broadcast (torch.distributed _sync_params_and_buffers)",
        ),
        (
            f'  File "{TORCH}/distributed/distributed_c10d.py", line 2950, in all_reduce\n',
            "torch.distributed",
        ),
    ],
)
def test_a_rank_blocked_in_torchs_other_collective_machinery_names_it_and_the_peer_it_waits_for(
    innermost: str, place: str
) -> None:
    # A plain DDP model's buffer broadcast before its forward, its constructor's state broadcast, or a
    # collective called through a name imported before ddpscope installed its recorder.
    job = started(2)
    end = job.train(3)
    blocked_in(job, 0, end + 5, '  File "/proj/gan.py", line 33, in <module>\n' + innermost)
    stuck_hang(job, 1, end + 5, step=3, phase="after_forward")
    hangs = hangs_by_rank(job, end + 6)
    assert hangs[0].culprit_ranks == [1] and f"in {place}" in hangs[0].message
    assert hangs[1].culprit_ranks == [1]


def test_a_rank_busy_on_the_cpu_inside_torchs_backward_is_computing_not_waiting() -> None:
    # Every rank trains the plain model for longer than the hang timeout: the watchdog sees no progress,
    # the report catches one rank inside backward, the other in its own code. Nobody waits.
    job = started(2)
    end = job.train(3)
    blocked_in(job, 0, end + 5, cpu_s=4.2)
    stuck_hang(job, 1, end + 5, step=3, phase="after_forward")
    snap = job.snapshot()
    assert job_status(snap, end + 6) == "running"
    assert "hang" not in kinds(diagnose(snap, end + 6))


def test_the_main_threads_cpu_share_of_the_stall_tells_a_wait_from_work_and_without_it_the_stack_decides() -> (
    None
):
    job = started(2)
    blocked_in(job, 0, job.train(3) + 5, cpu_s=0.0)
    (report,) = job.snapshot().hangs
    assert native_wait(report) is not None
    assert native_wait({**report, "main_cpu_s": 4.2}) is None
    assert native_wait({**report, "main_cpu_s": 0.1}) is not None
    assert native_wait({**report, "main_cpu_s": None}) is not None


def test_a_wait_in_an_unrecorded_collective_is_a_hang_when_the_peer_went_silent() -> None:
    job = started(2)
    end = job.train(3)
    # Rank 1 is SIGSTOPped before the plain model's backward: it reports nothing more.
    blocked_in(job, 0, end + 5)
    job.heartbeat(0, end + 20, step=3, phase="after_forward", last=6)
    incidents = diagnose(job.snapshot(), end + 21)
    assert only(incidents, "rank_silent").culprit_ranks == [1]
    hang = only(incidents, "hang")
    assert hang.rank == 0 and hang.culprit_ranks == [1] and hang.active


def test_ranks_blocked_at_the_same_place_wait_alongside_each_other_for_the_rank_elsewhere() -> None:
    job = started(3)
    end = job.train(3)
    blocked_in(job, 0, end + 5)
    blocked_in(job, 1, end + 5.1)
    stuck_hang(job, 2, end + 5, step=3, phase="after_forward")
    hangs = hangs_by_rank(job, end + 6)
    assert [hangs[r].culprit_ranks for r in (0, 1, 2)] == [[2], [2], [2]]
    assert "while ranks 0, 1 wait for it" in hangs[2].message


def test_a_timeout_in_an_unrecorded_collective_is_blamed_on_the_stuck_peer_not_on_the_waiting_rank() -> None:
    job = started(2)
    end = job.train(3)
    blocked_in(job, 0, end + 5)
    stuck_hang(job, 1, end + 5, step=3, phase="after_forward", line=19)
    job.error(
        0, end + 10, "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv", step=3
    )
    job.exit(0, end + 10.1, reason="error", step=3)
    err = only(diagnose(job.snapshot(), end + 11), "rank_error")
    assert err.culprit_ranks == [1], err.message
    assert "rank 1 was stuck between forward and backward at step 3 at /proj/data.py:19" in err.message


def test_every_rank_writing_a_distributed_checkpoint_is_not_a_hang() -> None:
    # File writes in torch.distributed.checkpoint block on the disk, not on a peer.
    job = started(2)
    end = job.train(3)
    write = f'  File "/proj/gan.py", line 50, in <module>\n  File "{TORCH}/distributed/checkpoint/filesystem.py", line 300, in _write_files\n'
    for r in range(2):
        blocked_in(job, r, end + 5, write)
    snap = job.snapshot()
    assert job_status(snap, end + 6) == "running" and "hang" not in kinds(diagnose(snap, end + 6))


def test_a_rank_blocked_in_an_unrecorded_collective_is_said_to_be_there_when_it_never_issued_a_recorded_one() -> (
    None
):
    # Rank 1 waits in a recorded all-reduce that rank 0 never issues: rank 0 is blocked in the plain
    # model's backward (which rank 1 has not reached). Rank 0 never issued #7, and where it is instead
    # is said; rank 1, the rank waiting, is never blamed, also once its wait timed out.
    job = started(2)
    end = job.train(3)
    blocked_in(job, 0, end + 5)
    job.coll(1, end, 7, site="train.py:57", done=False, step=3)
    job.hang(1, end + 5, step=3, inflight=[inflight(7, end)])
    incidents = diagnose(job.snapshot(), end + 6)
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert hangs[0].culprit_ranks == hangs[1].culprit_ranks == [0]
    blocked = "blocked in torch's backward pass at /proj/gan.py:27"
    assert blocked in hangs[1].message and blocked in only(incidents, "missing_collective").message
    job.error(
        1, end + 10, "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv", step=3
    )
    job.exit(1, end + 10.1, reason="error", step=3)
    incidents = diagnose(job.snapshot(), end + 11)
    assert only(incidents, "rank_error").culprit_ranks == [0]
    assert all(i.culprit_ranks == [0] for i in incidents), [i.message for i in incidents]


IN_STATE_BROADCAST = (
    '  File "/proj/train.py", line 11, in <module>\n'
    f'  File "{TORCH}/nn/parallel/distributed.py", line 894, in __init__\n'
    f'  File "{TORCH}/nn/parallel/distributed.py", line 1160, in _sync_module_states\n'
    f'  File "{TORCH}/distributed/utils.py", line 304, in _sync_module_states\n'
    f'  File "{TORCH}/distributed/utils.py", line 315, in _sync_params_and_buffers\n'
)
"""Where torch's DDP constructor broadcasts rank 0's parameters and buffers, in C++."""


def test_a_rank_left_in_the_constructors_state_broadcast_its_peer_finished_is_told_the_models_differ() -> (
    None
):
    # A layer made float64 on rank 0 only: torch's constructor compares shapes alone, so its broadcast
    # moved more bytes on rank 0, rank 1 went on to its next collective and rank 0 stayed. "Find why
    # those ranks skip this call" sent the user looking for a branch that did not exist.
    job = JobRecords(2)
    job.start(1)
    job.coll(1, T0 + 1, 1, op="send", pg="default:p2p:0-1", shapes=[[2]], dtypes=["int64"], done=False)
    job.hang(1, T0 + 6, step=0, inflight=[inflight(1, T0 + 1, pg="default:p2p:0-1")])
    blocked_in(job, 0, T0 + 6, IN_STATE_BROADCAST, step=0)
    missing = only(diagnose(job.snapshot(), T0 + 7), "missing_collective")
    assert missing.culprit_ranks == [0], missing.message
    assert (
        "blocked in DistributedDataParallel's state broadcast (torch.distributed _sync_params_and_buffers)"
        in (missing.message)
    )
    assert "the ranks' models differ in a parameter's or buffer's dtype" in missing.message, missing.message
    assert "Find why those ranks skip this call" not in missing.message


IN_RENDEZVOUS = (
    '  File "/proj/train.py", line 6, in <module>\n'
    f'  File "{TORCH}/distributed/distributed_c10d.py", line 1892, in init_process_group\n'
    f'  File "{TORCH}/distributed/rendezvous.py", line 280, in _env_rendezvous_handler\n'
    f'  File "{TORCH}/distributed/rendezvous.py", line 199, in _create_c10d_store\n'
)
"""Rank 0 in init_process_group: its TCPStore waits until every rank has connected."""


def test_a_rank_waiting_in_the_rendezvous_blames_the_ranks_never_heard_of_as_never_joined() -> None:
    # Rank 1's node never launched: rank 0 alone reports, from inside init_process_group.
    job = JobRecords(2)
    job.add("heartbeat", 0, T0 + 5, phase="idle", step=0, last_coll_seq=0, pid=1000, world_size=2)
    blocked_in(job, 0, T0 + 5, IN_RENDEZVOUS, step=0)
    snap = job.snapshot()
    assert job_status(snap, T0 + 6) == "hung"
    incidents = diagnose(snap, T0 + 6)
    silent = only(incidents, "rank_silent")
    assert silent.rank == 1 and silent.culprit_ranks == [1]
    assert "waits in init_process_group's rendezvous" in silent.message
    assert "never started" in silent.message and "MASTER_ADDR:MASTER_PORT" in silent.message
    hang = only(incidents, "hang")
    assert hang.culprit_ranks == [1] and "rank 1 (never joined the rendezvous)" in hang.message
    assert "blocked, waiting for the job's ranks" in hang.message
    assert "a collective ddpscope does not record" not in hang.message


IN_GROUP_CONSTRUCTION = (
    '  File "/proj/train.py", line 6, in <module>\n'
    f'  File "{TORCH}/distributed/distributed_c10d.py", line 1922, in init_process_group\n'
    f'  File "{TORCH}/distributed/distributed_c10d.py", line 2141, in _new_process_group_helper\n'
)
"""Rank 1 through the rendezvous (connected to rank 0's store), its gloo group connecting to every rank."""


def test_ranks_waiting_in_the_rendezvous_and_the_groups_construction_blame_only_the_rank_that_never_came() -> (
    None
):
    # WORLD_SIZE=3 with two ranks launched (a real run's shapes): rank 0 hosts the store and waits there for
    # all three; rank 1 got through to it and waits in its group's construction for the others.
    job = JobRecords(3)
    for r, stack in ((0, IN_RENDEZVOUS), (1, IN_GROUP_CONSTRUCTION)):
        job.add("heartbeat", r, T0 + 5, phase="idle", step=0, last_coll_seq=0, pid=1000 + r, world_size=3)
        blocked_in(job, r, T0 + 5, stack, step=0)
    hangs = hangs_by_rank(job, T0 + 6)
    for r in (0, 1):
        assert hangs[r].culprit_ranks == [2], hangs[r].message  # type: ignore[attr-defined]
        assert "culprit: rank 2 (never joined the rendezvous)." in hangs[r].message  # type: ignore[attr-defined]


def test_a_rank_blocked_while_a_process_group_connects_is_told_as_that_construction() -> None:
    job = JobRecords(2)
    blocked_in(job, 0, T0 + 5, IN_GROUP_CONSTRUCTION, step=0)
    wait = native_wait(job.snapshot().hangs[0])
    assert (
        wait is not None
        and wait.place == "a process group's construction (torch.distributed _new_process_group_helper)"
    )
    assert "WORLD_SIZE" in (wait.advice or "")


def test_a_rendezvous_wait_that_ended_names_the_rank_that_came_late_and_why() -> None:
    # Rank 0 prepared its dataset alone before init_process_group: rank 1 waited 18 s in the rendezvous.
    job = JobRecords(2)
    blocked_in(job, 1, T0 + 5, IN_RENDEZVOUS, step=0)
    job.add("hang_resolved", 1, T0 + 18.1, step=0, hang_s=18.1)
    job.start(0, T0 + 18.5)
    job.start(1, T0 + 18.6)
    (hang,) = [i for i in diagnose(job.snapshot(), T0 + 20) if i.kind == "hang"]
    assert hang.culprit_ranks == [0] and not hang.active, hang
    assert (
        "culprit: rank 0 (reached init_process_group late, ready only 18 s after this rank began waiting: code of "
        "its own before it (a dataset downloaded or prepared on that rank alone) ran that much longer)"
    ) in hang.message, hang.message
