"""A job that torchrun restarts in place and that dies of the same error every time (synthetic records):
the current attempt's error says how many earlier attempts it ended, so nobody restarts it once more."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import T0, JobRecords, inflight, only, started

STACK = (
    "Traceback (most recent call last):\n"
    '  File "/proj/train.py", line {line}, in <module>\n'
    "    batch = next(loader)\n"
    "{error}: bad sample 1234\n"
)


def crash(job: JobRecords, rank: int, t: float, *, error: str = "ValueError", line: int = 9) -> None:
    job.add("rank_error", rank, t, step=1, phase="idle", error_type=error, message="bad sample 1234",
            stack=STACK.format(line=line, error=error), fatal=True)  # fmt: skip
    job.add("rank_error", 1 - rank, t + 0.3, step=2, phase="allreduce", error_type="RuntimeError",
            message="[pair.cc:553] Connection closed by peer [127.0.0.1]:435", stack="...", fatal=True)  # fmt: skip


def attempts(errors: list[tuple[int, str, int]]) -> tuple[JobRecords, float]:
    """One attempt per (rank, error type, line): both ranks start, train 2 steps, that rank raises."""
    job = started(2)
    t = 1_700_000_001.0
    for i, (rank, error, line) in enumerate(errors):
        if i:
            for r in (0, 1):
                job.start(r, t)
        t = job.train(2, t=t + 0.5)
        crash(job, rank, t, error=error, line=line)
        t += 10
    return job, t


def test_the_same_error_ending_every_attempt_is_said_on_the_current_one_with_the_count() -> None:
    job, t = attempts([(1, "ValueError", 9)] * 4)
    current = [i for i in diagnose(job.snapshot(), t) if i.active and i.kind == "rank_error"]
    assert len(current) == 1 and current[0].culprit_ranks == [1]
    assert (
        "The same error (ValueError at /proj/train.py:9) also ended 3 earlier attempts of this job: restarting "
        "does not get past it" in current[0].message
    )


def test_an_error_that_moves_between_ranks_is_counted_at_least_once_per_attempt() -> None:
    job, t = attempts([(1, "ValueError", 9), (0, "ValueError", 9), (1, "ValueError", 9)])
    (current,) = [i for i in diagnose(job.snapshot(), t) if i.active and i.kind == "rank_error"]
    assert "also ended at least 1 earlier attempt of this job" in current.message


def test_a_different_error_after_a_restart_says_nothing_of_a_loop() -> None:
    job, t = attempts([(1, "ValueError", 9), (1, "KeyError", 30)])
    (current,) = [i for i in diagnose(job.snapshot(), t) if i.active and i.kind == "rank_error"]
    assert "earlier attempt" not in current.message


def stray_barrier(job: JobRecords, t: float) -> float:
    """An attempt whose rank 1 calls a barrier rank 0 never calls after 8 steps: a mismatch, both ranks
    hang, the process group's timeout fails both, both exit. Returns when the attempt ended."""
    end = job.train(8, t=t)
    job.coll(0, end, 17, shapes=[[10]], site="ddp/reducer.py:88", source="engine", step=8, done=False)
    job.coll(1, end, 17, op="barrier", reduce_op=None, shapes=[], site="train.py:120", done=False)
    job.hang(0, end + 5, step=8, inflight=[inflight(17, end, site="ddp/reducer.py:88")])
    for r in (0, 1):
        job.error(r, end + 30, "Timed out waiting 30000ms for recv operation to complete", step=8)
        job.exit(r, end + 30.1, reason="error", step=8)
    return end + 31


def test_the_same_mismatch_stopping_every_attempt_says_so_on_the_current_one_with_the_count() -> None:
    job = started(2)
    t = stray_barrier(job, T0 + 1)
    for _ in range(2):
        for r in (0, 1):
            job.start(r, t + 5)
        t = stray_barrier(job, t + 6)
    incidents = diagnose(job.snapshot(), t)
    mismatch = only([i for i in incidents if i.active], "mismatch")
    assert mismatch.message.endswith(
        "The same collective mismatch at train.py:120 stopped 2 earlier attempts of this job too: restarting does "
        "not get past it; fix its cause before the next restart, or stop restarting it (torchrun --max-restarts)."
    ), mismatch.message
    hangs = [i for i in incidents if i.active and i.kind == "hang"]
    assert hangs and not any("earlier attempt" in h.message for h in hangs)  # the mismatch's waiting ranks
    history = [i.message for i in incidents if not i.active and i.kind == "mismatch"]
    assert [m[: len("In attempt 1 of 3")] for m in history] == ["In attempt 1 of 3", "In attempt 2 of 3"]


def test_a_hang_in_the_first_attempt_stays_on_record_when_the_second_failed_otherwise() -> None:
    job = started(2)
    t = stray_barrier(job, T0 + 1)
    for r in (0, 1):
        job.start(r, t + 5)
    t = job.train(3, t=t + 6)
    crash(job, 1, t)
    for r in (0, 1):
        job.exit(r, t + 1, reason="error", step=2)
        job.start(r, t + 10)
    t = job.train(3, t=t + 11)
    incidents = diagnose(job.snapshot(), t)
    assert not [i for i in incidents if i.active]
    history = {(i.kind, i.message[: len("In attempt 1 of 3")]) for i in incidents}
    assert ("mismatch", "In attempt 1 of 3") in history and ("rank_error", "In attempt 2 of 3") in history, [
        i.message for i in incidents
    ]
