"""Where a blamed rank was when a peer gave up on it: its watchdog's samples of a stall of its own
(``analysis/stalled_culprits.py``), on synthetic records of a process-group timeout shorter than the
hang timeout, so the late rank never sent a hang report of its own."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_hang_diagnosis import late_peer_job, stuck_hang
from tests.server.test_incidents import JobRecords, only


def sample(
    job: JobRecords, rank: int, t: float, stalled_s: float, *, step: int = 2, cpu: float = 0.0
) -> None:
    stack = '  File "/proj/train.py", line 40, in <module>\n    save(model)\n  File "/proj/ckpt.py", line 7, in save\n'
    job.add("stall_sample", rank, t, step=step, phase="idle", stalled_s=stalled_s, site="ckpt.py:7", stack=stack,
            main_cpu_s=cpu)  # fmt: skip


def late_checkpoint(samples_s: list[float], *, cpu: float = 0.0) -> tuple[JobRecords, float]:
    """``late_peer_job`` (rank 0 saves a checkpoint for 9 s after step 2, rank 1 gives up in #7 after 5 s),
    rank 0's stall sampled at ``samples_s`` into it."""
    job, end = late_peer_job()
    for s in samples_s:
        sample(job, 0, end + s, s, cpu=cpu * s)
    return job, end


def test_the_late_rank_is_said_to_have_been_in_its_own_stall_at_the_sampled_line_when_its_peer_gave_up() -> (
    None
):
    job, end = late_checkpoint([0.5, 1.0, 2.0, 4.0, 8.0])
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert err.culprit_ranks == [0], err.message
    assert err.message.endswith(
        " Rank 0 was then 6.0 s into a stall of its own after step 2 (between steps), at ckpt.py:7, blocked (I/O, "
        "a lock, a sleep or a queue) (its watchdog's sample 8.0 s in)."
    ), err.message


def test_without_a_sample_after_the_failure_the_last_one_half_way_there_stands_and_busy_is_said() -> None:
    job, end = late_checkpoint([0.5, 1.0, 2.0, 4.0], cpu=0.9)
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert (
        "Rank 0 was then 6.0 s into a stall of its own after step 2 (between steps), at ckpt.py:7, busy on the "
        "CPU (its watchdog's sample 4.0 s in)." in err.message
    ), err.message


def test_a_stall_that_had_ended_before_the_peer_gave_up_is_not_said() -> None:
    # Sampled 0.5 and 1 s in, then no more: the stall ended before its 2 s sample was due, long before the
    # failure 6 s in.
    job, end = late_checkpoint([0.5, 1.0])
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert err.culprit_ranks == [0] and "stall of its own" not in err.message, err.message


def test_a_rank_that_went_on_to_a_collective_after_its_last_sample_is_not_said_to_be_stalled() -> None:
    job, end = late_checkpoint([0.5, 1.0, 2.0, 4.0])
    job.coll(0, end + 4.5, 6, site="train.py:50", step=3)  # its stall was over: it went on
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert "stall of its own" not in err.message, err.message


def test_a_late_rank_waiting_for_its_dataloaders_workers_is_said_to_wait_for_them() -> None:
    job, end = late_peer_job()
    loader = "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py"
    stack = (
        '  File "/proj/train.py", line 16, in <module>\n    for x in loader:\n'
        f'  File "{loader}", line 733, in __next__\n    data = self._next_data()\n'
        '  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113, in get\n    if not self._poll(timeout):\n'
    )
    for s in (0.5, 1.0, 2.0, 4.0, 8.0):
        job.add("stall_sample", 0, end + s, step=2, phase="idle", stalled_s=s, site="train.py:16", stack=stack,
                main_cpu_s=0.0)  # fmt: skip
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert (
        "Rank 0 was then 6.0 s into a stall of its own after step 2 (between steps), at train.py:16, waiting for "
        "its DataLoader's workers to deliver the next batch, blocked" in err.message
    ), err.message


def test_a_stall_its_rank_reported_as_a_hang_is_not_said_again_from_its_samples() -> None:
    # Rank 0's hang timeout came first this time: its hang report (begun with the stall) says where it was.
    job, end = late_checkpoint([0.5, 1.0, 2.0, 4.0, 8.0])
    stuck_hang(job, 0, end + 5, step=2, phase="idle")  # stalled 5 s: the same stall
    err = only(diagnose(job.snapshot(), end + 10), "rank_error")
    assert err.culprit_ranks == [0] and "stall of its own" not in err.message, err.message
