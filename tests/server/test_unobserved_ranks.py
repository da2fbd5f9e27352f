"""Ranks that run without ddpscope beside ranks that run it (``DDPSCOPE_DISABLED`` on one node only): the
ranks that run it name them in their ``rank_start`` (``unobserved_ranks``), so the job is judged on the
ranks it can hear, and the incident says why the others are missing (synthetic records)."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import job_status
from tests.server.test_incidents import T0, JobRecords, kinds


def half_observed(world: int = 2) -> tuple[JobRecords, float]:
    job = JobRecords(world)
    job.start(0)
    job.records[-2]["unobserved_ranks"] = list(range(1, world))  # the rank_start, before its layout
    assert job.records[-2]["kind"] == "rank_start"
    end = job.train(5, ranks=[0])
    job.exit(0, end + 0.1)
    return job, end + 0.2


def test_a_job_whose_only_silent_ranks_run_without_ddpscope_finishes_with_one_incident_naming_them() -> None:
    job, t = half_observed(3)
    assert job_status(job.snapshot(), t + 120) == "finished"  # was 'hung': ranks 1 and 2 never reported
    incidents = diagnose(job.snapshot(), t + 120)
    assert kinds(incidents) == ["settings_differ"]
    (incident,) = incidents
    assert incident.culprit_ranks == [1, 2]
    assert incident.message.startswith("Ranks 1, 2 run without ddpscope (DDPSCOPE_DISABLED set on that node")


def test_a_rank_named_unobserved_that_reports_after_all_is_judged_like_any_other() -> None:
    job, t = half_observed(2)
    job.start(1, T0 + 0.5)  # it did run ddpscope (it started late): its records count again
    assert "settings_differ" not in kinds(diagnose(job.snapshot(), t))


def test_the_engines_refusal_of_a_peer_without_ddpscope_blames_that_peer_not_the_rank_that_raised() -> None:
    from ddpscope.ddp.engine import WITHOUT_DDPSCOPE

    job = JobRecords(2)
    job.error(0, T0 + 5, WITHOUT_DDPSCOPE.format(ranks=[1]), step=None)
    (incident,) = [i for i in diagnose(job.snapshot(), T0 + 6) if i.kind == "rank_error"]
    assert incident.culprit_ranks == [1] and "The cause is on rank 1" in incident.message
