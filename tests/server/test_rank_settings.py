"""Settings the ranks of a job must agree on (versions, world size, hang timeout, how the model is
wrapped), compared across their ``rank_start`` records: one ``settings_differ`` incident per job naming
each differing setting, its values and the odd ranks."""

from __future__ import annotations

from typing import Any

import pytest

from ddpscope.agent.records import validate_record
from ddpscope.server.analysis.incident_model import INCIDENT_KINDS, Incident
from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.rank_settings import SETTINGS, settings_incidents
from ddpscope.server.analysis.status import job_status
from tests.server.test_incidents import T0, JobRecords, kinds, only

DIFFERENT = {
    "torch_version": ("2.12.1", "2.13.0", "2.12.1"),
    "python_version": ("3.10", "3.11", "3.10"),
    "ddpscope_version": ("0.0.9", "0.1.0", "0.0.9"),
    "backend": ("nccl", "gloo", "nccl"),
    "engine": ("torch", "ddpscope", "torch"),
    "find_unused_parameters": (True, "False", "True"),
    "bucket_cap_mb": (50.0, "25", "50"),
    "static_graph": (True, "False", "True"),
    "world_size": (8, "4", "8"),
    "hang_timeout_s": (8.0, "300", "8"),
}
"""For every setting compared: a value other than ``job()``'s, and how the message shows ``job()``'s and
that one."""


def start(job: JobRecords, rank: int, t: float = T0, **settings: Any) -> None:
    """``rank`` starts (again, as a new process, if it started before) with ``settings`` over the
    defaults; a setting given as None is left out of the record, as an older agent does."""
    job.start(rank, t)
    rec = next(r for r in reversed(job.records) if r["kind"] == "rank_start" and r["rank"] == rank)
    rec.update(static_graph=False, hang_timeout_s=300.0, process_group="default")
    for name, value in settings.items():
        if value is None:
            rec.pop(name, None)
        else:
            rec[name] = value
    validate_record(rec)


def job(world: int = 4, **per_rank: dict[str, Any]) -> JobRecords:
    """A job whose ranks start alike except ``per_rank`` (``r1={"hang_timeout_s": 8.0}``)."""
    j = JobRecords(world)
    for r in range(world):
        start(j, r, **per_rank.get(f"r{r}", {}))
    return j


def settings_differ(j: JobRecords, now_s: float = T0 + 5) -> Incident:
    return only(diagnose(j.snapshot(), now_s), "settings_differ")


def test_the_kind_is_an_incident_kind_and_every_setting_has_a_differing_value_in_these_tests() -> None:
    assert "settings_differ" in INCIDENT_KINDS
    assert set(SETTINGS) == set(DIFFERENT)


def test_a_healthy_job_whose_ranks_agree_gets_no_incident() -> None:
    j = job(4)
    end = j.train(5)
    assert diagnose(j.snapshot(), end + 0.5) == []


@pytest.mark.parametrize("field", sorted(DIFFERENT))
def test_every_setting_that_differs_on_one_rank_is_named_with_its_values_and_that_rank(field: str) -> None:
    value, usual, odd = DIFFERENT[field]
    inc = settings_differ(job(4, r2={field: value}))
    assert inc.culprit_ranks == [2] and inc.rank == 2
    assert f"{field} is {usual} on ranks 0, 1, 3 but {odd} on rank 2" in inc.message, inc.message
    assert inc.active and inc.time_s == T0
    assert "a tie" not in inc.message


def test_each_setting_says_what_goes_wrong_and_what_to_do() -> None:
    advice = {
        "hang_timeout_s": "set DDPSCOPE_HANG_TIMEOUT the same on every rank",
        "torch_version": "install the same wheel or image on every node",
        "world_size": "launched with different WORLD_SIZE values",
        "bucket_cap_mb": "build different buckets, so their gradient all-reduces pair wrongly or hang",
        "engine": "wrap the model the same way on every rank",
        "backend": "pass the same backend to init_process_group on every rank",
    }
    for field, words in advice.items():
        assert words in settings_differ(job(2, r1={field: DIFFERENT[field][0]})).message, field
    stall = settings_differ(job(2, r1={"hang_timeout_s": 8.0})).message
    assert "A stall only the shorter hang timeout sees is reported by those ranks alone" in stall


def test_a_bucket_cap_that_torch_ddp_ignores_is_named_without_claiming_the_all_reduces_pair_wrongly() -> None:
    torch_ddp = {"engine": "torch", "find_unused_parameters": False}
    inc = settings_differ(job(2, r0=torch_ddp, r1={**torch_ddp, "bucket_cap_mb": 1.0}))
    assert inc.culprit_ranks == [1] and "bucket_cap_mb is 25 on rank 0 but 1 on rank 1" in inc.message
    assert "gives every rank rank 0's bucket layout" in inc.message and "pair wrongly" not in inc.message


@pytest.mark.parametrize(
    "others",
    [
        {"engine": "torch", "find_unused_parameters": True},  # torch never rebuilds: each rank keeps its own
        {
            "engine": "ddpscope",
            "find_unused_parameters": False,
        },  # the engine refuses it; an older one did not
    ],
)
def test_a_bucket_cap_that_decides_the_buckets_still_says_the_all_reduces_pair_wrongly(
    others: dict[str, Any],
) -> None:
    inc = settings_differ(job(2, r0=others, r1={**others, "bucket_cap_mb": 1.0}))
    assert "build different buckets, so their gradient all-reduces pair wrongly or hang" in inc.message
    assert "rank 0's bucket layout" not in inc.message


def test_every_differing_setting_is_listed_in_one_incident_with_the_culprits_of_each() -> None:
    j = job(4, r1={"hang_timeout_s": 8.0}, r3={"torch_version": "2.12.1", "python_version": "3.10"})
    inc = settings_differ(j)
    assert inc.culprit_ranks == [1, 3] and inc.rank is None
    assert "torch_version is 2.13.0 on ranks 0-2 but 2.12.1 on rank 3" in inc.message
    assert "python_version is 3.11 on ranks 0-2 but 3.10 on rank 3" in inc.message
    assert "hang_timeout_s is 300 on ranks 0, 2, 3 but 8 on rank 1" in inc.message
    # One sentence per kind of setting: the two versions share theirs.
    assert inc.message.count("install the same wheel or image") == 1
    assert "Ranks with different torch_version or python_version (a stale image" in inc.message


def test_the_minority_is_the_culprit_whichever_rank_holds_it() -> None:
    j = job(5, r0={"hang_timeout_s": 8.0}, r1={"hang_timeout_s": 8.0})
    inc = settings_differ(j)
    assert inc.culprit_ranks == [0, 1]
    assert "hang_timeout_s is 8 on ranks 0, 1 but 300 on ranks 2-4" in inc.message


def test_with_three_values_every_rank_off_the_most_common_one_is_named() -> None:
    j = job(5, r3={"bucket_cap_mb": 50.0}, r4={"bucket_cap_mb": 10.0})
    inc = settings_differ(j)
    assert inc.culprit_ranks == [3, 4]
    assert "bucket_cap_mb is 25 on ranks 0-2 but 50 on rank 3 and 10 on rank 4" in inc.message


def test_on_a_tie_the_ranks_that_differ_from_rank_0_are_named_and_the_message_says_so() -> None:
    inc = settings_differ(job(2, r1={"hang_timeout_s": 8.0}))
    assert inc.culprit_ranks == [1]
    tie = (
        "hang_timeout_s is 300 on rank 0 but 8 on rank 1 (a tie: rank 1, which differs from rank 0, is named)"
    )
    assert tie in inc.message
    inc = settings_differ(job(4, r0={"find_unused_parameters": True}, r1={"find_unused_parameters": True}))
    assert inc.culprit_ranks == [2, 3]
    assert "ranks 2, 3, which differ from rank 0, are named" in inc.message


def test_a_setting_a_record_lacks_is_not_compared() -> None:
    # An older agent sends no hang_timeout_s: nothing to compare it with, whatever the others say.
    j = job(3, r1={"hang_timeout_s": None}, r2={"hang_timeout_s": 8.0, "static_graph": None})
    inc = settings_differ(j)
    assert "hang_timeout_s is 300 on rank 0 but 8 on rank 2" in inc.message
    assert inc.culprit_ranks == [2]
    assert "static_graph" not in inc.message
    assert settings_incidents(job(3, r1={"hang_timeout_s": None, "static_graph": None}).snapshot()) == []


def test_how_the_model_is_wrapped_is_compared_within_each_ddp_group_only() -> None:
    # One model per pipeline stage on disjoint groups: the stages may be wrapped differently; the versions
    # and the hang timeout must still agree across the whole job.
    stage = {"process_group": "pg:1", "bucket_cap_mb": 50.0, "find_unused_parameters": True}
    j = job(4, r2=stage, r3=stage)
    assert settings_incidents(j.snapshot()) == []
    j = job(4, r2=stage, r3={**stage, "bucket_cap_mb": 100.0, "hang_timeout_s": 8.0})
    inc = settings_differ(j)
    assert "bucket_cap_mb is 50 on rank 2 but 100 on rank 3 in group pg:1" in inc.message
    assert "hang_timeout_s is 300 on ranks 0-2 but 8 on rank 3" in inc.message
    assert inc.culprit_ranks == [3]


def test_a_restarted_job_compares_its_new_processes_only() -> None:
    # The first attempt ran with a short timeout on rank 1; the job came back with it fixed.
    j = job(2, r1={"hang_timeout_s": 8.0})
    end = j.train(3)
    for r in range(2):
        start(j, r, end + 5)
    end = j.train(3, t=end + 6)
    assert kinds(diagnose(j.snapshot(), end + 0.5)) == []


def test_a_rank_whose_new_process_has_not_started_its_model_is_left_out_until_it_has() -> None:
    # A new image on every node: rank 0's new process is up, rank 1's still builds its model. Its last
    # rank_start is its earlier process's, from before the restart: not compared with rank 0's new one.
    j = job(2, r0={"torch_version": "2.12.1"}, r1={"torch_version": "2.12.1"})
    end = j.train(3)
    start(j, 0, end + 5)
    assert settings_incidents(j.snapshot()) == []
    start(j, 1, end + 6, torch_version="2.12.1")  # a stale image on rank 1's node after all
    inc = settings_differ(j, end + 7)
    assert inc.culprit_ranks == [1]
    assert "torch_version is 2.13.0 on rank 0 but 2.12.1 on rank 1" in inc.message


def test_a_settings_difference_does_not_change_the_job_status() -> None:
    j = job(2, r1={"hang_timeout_s": 8.0})
    end = j.train(5)
    assert job_status(j.snapshot(), end + 0.5) == "running"
    for r in range(2):
        j.exit(r, end)
    assert job_status(j.snapshot(), end + 0.5) == "finished"
    assert kinds(diagnose(j.snapshot(), end + 0.5)) == ["settings_differ"]


def test_a_large_job_names_runs_of_ranks_as_spans() -> None:
    inc = settings_differ(job(64, r17={"world_size": 32}))
    assert "world_size is 64 on ranks 0-16, 18-63 but 32 on rank 17" in inc.message


def test_ranks_stuck_in_init_process_group_are_compared_by_the_world_size_their_heartbeats_say() -> None:
    # Rank 1 launched with WORLD_SIZE=3: the group's connection waits and no rank builds its model, so no
    # rank_start comes; the heartbeats each rank sends once its wait is reported carry the size it asked for.
    j = JobRecords(2)
    for rank, size in ((0, 2), (1, 3)):
        j.add(
            "heartbeat", rank, T0 + 5, phase="idle", step=0, last_coll_seq=0, pid=1000 + rank, world_size=size
        )
    inc = settings_differ(j, T0 + 6)
    assert inc.culprit_ranks == [1]
    assert "world_size is 2 on rank 0 but 3 on rank 1" in inc.message
    assert "launch every rank with the same WORLD_SIZE" in inc.message


def test_a_rank_start_outranks_the_heartbeat_for_the_world_size() -> None:
    # Once a rank has built its model, its rank_start says the group's size: no second source to disagree.
    j = job(2)
    j.add("heartbeat", 1, T0 + 5, phase="idle", step=0, last_coll_seq=0, pid=1001, world_size=3)
    assert settings_incidents(j.snapshot()) == []
