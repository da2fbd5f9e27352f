"""A job that torchrun restarts in place and that dies of the same error every time (synthetic records):
the current attempt's error says how many earlier attempts it ended, so nobody restarts it once more."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import JobRecords, started

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
