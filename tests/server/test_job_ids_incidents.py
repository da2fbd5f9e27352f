"""``job_ids_differ`` warnings as incidents: the ranks of one job id that said it are one incident, whose
culprits are the ranks the message calls misconfigured (who are in another job), not the ranks that said it.
The real 2-rank jobs are in ``test_job_ids_differ_jobs.py``."""

from __future__ import annotations

from ddpscope.agent.rank_spans import MAX_PARSED_RANKS
from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.status import job_status
from ddpscope.server.analysis.warning_incidents import misconfigured_ranks
from tests.server.test_incidents import JobRecords

T0 = 1_700_000_000.0
MESSAGE = (
    "the ranks of this torch job report to ddpscope under 2 job ids: 'train' (ranks 0, 2, 3; DDPSCOPE_JOB) "
    "and 'oops' (rank 1; DDPSCOPE_JOB). Probably misconfigured: rank 1 on node-2 (the fewer ranks). Each id is "
    "a job of its own at the collector, whose diagnosis calls the other ids' ranks silent or never seen. Give "
    "every rank the same DDPSCOPE_JOB, or unset it on every rank and let torchrun's TORCHELASTIC_RUN_ID name "
    "the job."
)
"""What ``ddp/job_ids_text.job_ids_message`` writes for that job (the server tests import no torch)."""


def test_the_ranks_that_said_it_are_one_incident_blaming_the_rank_in_the_other_job() -> None:
    job = JobRecords(world=4, job="train")  # rank 1 reports under 'oops': never here
    for rank in (0, 2, 3):
        job.start(rank, T0)
        job.heartbeat(rank, T0 + 1)
    for rank in (3, 0, 2):
        job.add("warning", rank, T0 + 2 + rank / 100, step=None, code="job_ids_differ", message=MESSAGE)
    found = [i for i in diagnose(job.snapshot(), T0 + 3) if i.kind == "job_ids_differ"]
    (inc,) = found
    assert inc.message == f"Ranks 0, 2, 3: {MESSAGE}"
    assert (inc.rank, inc.step, inc.culprit_ranks, inc.parameters) == (0, None, [1], [])
    assert job_status(job.snapshot(), T0 + 3) == "running"


def test_the_misconfigured_ranks_are_read_as_written_and_a_forged_range_costs_little() -> None:
    assert misconfigured_ranks("x. Probably misconfigured: ranks 0-3, 7, 9, 10 on a, b (the fewer ranks).") == [
        0, 1, 2, 3, 7, 9, 10,
    ]  # fmt: skip
    assert misconfigured_ranks("Probably misconfigured: rank 12 (as many ranks use each id; ...)") == [12]
    assert misconfigured_ranks("no such phrase") == []
    assert len(misconfigured_ranks("Probably misconfigured: ranks 0-999999999, 5")) == MAX_PARSED_RANKS
    assert misconfigured_ranks("Probably misconfigured: ranks " + "9" * 5000 + ", 3") == [3]
