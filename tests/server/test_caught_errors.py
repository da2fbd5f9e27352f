"""Exceptions a training loop catches and goes on from: the engine reports them at once (non-fatal),
and the collector ties them to what they cause (a rank that runs out of batches first), or folds them
into the rank's death when nothing caught them after all."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import kinds, only, started


def caught(job, rank: int, t: float, *, step: int) -> None:  # type: ignore[no-untyped-def]
    job.add("rank_error", rank, t, step=step, phase="forward", error_type="ValueError",
            message="corrupt sample in forward", stack="Traceback ...\nValueError: corrupt sample", fatal=False)  # fmt: skip


def test_a_rank_that_caught_an_exception_and_skipped_a_step_is_told_as_such_when_it_runs_out_first() -> None:
    job = started(2)
    end = job.train(6)
    caught(job, 1, end - 0.35, step=3)
    job.exit(1, end, step=5)  # one batch fewer: its loop ended first
    job.error(0, end + 0.05, "Connection closed by peer", step=6)
    incidents = diagnose(job.snapshot(), end + 1)
    early = only(incidents, "rank_exited_early")
    assert early.culprit_ranks == [1]
    assert (
        "It raised at step 3 in forward and kept running: ValueError: corrupt sample in forward"
        in early.message
    )
    assert "skipped that step, so it ran fewer synced steps than its peers" in early.message
    assert "uneven data per rank" not in early.message
    assert only(incidents, "rank_error").message.startswith(
        "Rank 1 raised (and kept running) at step 3 in forward"
    )


def test_an_early_exit_with_no_caught_exception_still_points_at_uneven_inputs() -> None:
    job = started(2)
    end = job.train(6)
    job.exit(1, end, step=5)
    job.error(0, end + 0.05, "Connection closed by peer", step=6)
    early = only(diagnose(job.snapshot(), end + 1), "rank_exited_early")
    assert "uneven data per rank" in early.message and "Join" in early.message


def test_an_exception_reported_as_caught_that_then_killed_the_rank_is_one_error() -> None:
    job = started(2)
    end = job.train(3)
    caught(job, 1, end, step=3)
    # Nothing caught it after all: the same exception reached sys.excepthook.
    job.add("rank_error", 1, end + 0.01, step=3, phase="forward", error_type="ValueError",
            message="corrupt sample in forward", stack="Traceback ...\nValueError: corrupt sample", fatal=True)  # fmt: skip
    job.error(0, end + 0.05, "Connection closed by peer", step=3)
    incidents = diagnose(job.snapshot(), end + 1)
    assert kinds(incidents) == ["rank_error"]
    assert incidents[0].message.startswith("Rank 1 died at step 3 in forward: ValueError")
