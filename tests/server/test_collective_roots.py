"""Roots of rooted collectives and members of process groups in the cross-rank diagnosis.

Synthetic wire records (validated) built with ``tests.server.test_incidents``' ``JobRecords``: a
``collective`` record may carry ``root`` (broadcast/scatter src, reduce/gather dst, a global rank) and,
on a group other than the default one, ``group_ranks``. Records without them (older agents) must give
the diagnosis they gave before.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpscope.agent.records import RecordError, validate_record
from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import JobRecords, inflight, kinds, only, started


def coll(job: JobRecords, rank: int, t: float, seq: int, *, done: bool = True, **fields: Any) -> None:
    """A collective record (and its end unless ``done=False``) with any fields, root and group_ranks
    included; the defaults are a user broadcast of a [8] float32 tensor on the default group."""
    record = {
        "pg": "default", "coll_seq": seq, "op": "broadcast", "reduce_op": None, "shapes": [[8]],
        "dtypes": ["float32"], "call_site": "train.py:64", "start_ns": int(t * 1e9), "step": None,
        "source": "user",
    }  # fmt: skip
    record.update(fields)
    job.add("collective", rank, t, **record)
    if done:
        job.add(
            "collective_end",
            rank,
            t + 0.001,
            pg=record["pg"],
            coll_seq=seq,
            end_ns=int((t + 0.001) * 1e9),
            ok=True,
        )


# ------------------------------------------------------------------------------------------ the wire


def test_root_and_group_ranks_are_optional_and_root_may_be_null() -> None:
    job = started(2)
    coll(job, 0, 1.0, 1)  # neither field: an older agent
    coll(job, 0, 1.0, 2, root=None)
    coll(job, 0, 1.0, 1, pg="pg:1", op="all_reduce", reduce_op="SUM", group_ranks=[0, 1])
    with pytest.raises(RecordError, match="root"):
        validate_record({**job.records[-2], "root": "0"})
    with pytest.raises(RecordError, match="group_ranks"):
        validate_record({**job.records[-2], "group_ranks": 2})


# ----------------------------------------------------------------------------------------------- roots


def test_a_broadcast_with_a_different_src_on_each_rank_is_a_mismatch_naming_both_srcs_and_the_line() -> None:
    job = started(2)
    end = job.train(3)  # seqs 1..6
    for r in (0, 1):  # each rank believes it is the source: both wait until the timeout on gloo
        coll(job, r, end, 7, root=r, done=False)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.seq == 7 and m.pg == "default" and m.call_site == "train.py:64"
    assert m.culprit_ranks == [1]  # an even split: rank 0's call is the reference
    assert "rank 1 issued broadcast(src=1) [8] float32 at train.py:64" in m.message
    assert "where rank 0 issued broadcast(src=0) [8] float32 at train.py:64" in m.message
    assert "The roots differ (src)" in m.message and "timeout" in m.message


def test_the_odd_root_among_three_ranks_is_the_culprit() -> None:
    job = started(3)
    end = job.train(2)
    for r in range(3):
        coll(job, r, end, 5, op="scatter", root=2 if r == 2 else 0)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.culprit_ranks == [2]
    assert "rank 2 issued scatter(src=2)" in m.message and "ranks 0, 1 issued scatter(src=0)" in m.message


def test_a_reduce_to_different_dsts_names_the_reduce_op_and_the_dst() -> None:
    job = started(2)
    end = job.train(2)
    for r in (0, 1):
        coll(job, r, end, 5, op="reduce", reduce_op="SUM", root=r, shapes=[[4]])
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert "reduce(SUM, dst=1) [4] float32" in m.message and "reduce(SUM, dst=0) [4] float32" in m.message
    assert "The roots differ (dst)" in m.message and "receives" in m.message


def test_rooted_collectives_with_the_same_root_everywhere_are_healthy() -> None:
    job = started(3)
    end = job.train(2)
    for seq, op in enumerate(("broadcast", "gather", "reduce", "scatter"), start=5):
        for r in range(3):
            coll(job, r, end, seq, op=op, root=1, reduce_op="SUM" if op == "reduce" else None)
    assert diagnose(job.snapshot(), end + 0.5) == []


def test_records_without_a_root_are_not_compared_on_it() -> None:
    job = started(2)
    end = job.train(2)
    coll(job, 0, end, 5)  # an older agent on rank 0 (or the engine's own broadcast): no root
    coll(job, 1, end, 5, root=1)
    coll(job, 0, end, 6)
    coll(job, 1, end, 6)
    assert diagnose(job.snapshot(), end + 0.5) == []


def test_a_root_difference_is_found_even_when_the_call_sites_differ() -> None:
    # if rank == 0: broadcast(t, src=0) / else: broadcast(t, src=1): two lines, each run by one rank.
    job = started(2)
    end = job.train(2)
    coll(job, 0, end, 5, root=0, call_site="train.py:70")
    coll(job, 1, end, 5, root=1, call_site="train.py:72")
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert "broadcast(src=1) [8] float32 at train.py:72" in m.message
    assert "broadcast(src=0) [8] float32 at train.py:70" in m.message


def test_a_missing_collective_shows_the_root_of_the_awaited_broadcast() -> None:
    job = started(2)
    end = job.train(2)
    coll(job, 0, end, 5, root=0, done=False)
    job.heartbeat(0, end + 15, step=2, phase="idle", last=5)
    job.heartbeat(1, end + 15, step=2, phase="forward", last=4)
    missing = only(diagnose(job.snapshot(), end + 16), "missing_collective")
    assert missing.culprit_ranks == [1] and "in broadcast(src=0) [8] float32" in missing.message


# --------------------------------------------------------------------------------------- group members


def subgroup_hang(*, with_members: bool) -> tuple[JobRecords, float]:
    """3 ranks; group pg:1 = ranks 0 and 1. Rank 0 waits in pg:1 #1, which rank 1 never issues
    (it went on to the default group's next all-reduce, where it waits for rank 0 with rank 2)."""
    job = started(3)
    end = job.train(3)  # default seqs 1..6
    members = {"group_ranks": [0, 1]} if with_members else {}
    coll(
        job,
        0,
        end,
        1,
        pg="pg:1",
        op="all_reduce",
        reduce_op="SUM",
        call_site="train.py:80",
        done=False,
        **members,
    )
    job.hang(0, end + 5, step=3, phase="idle", inflight=[inflight(1, end, "train.py:80", pg="pg:1")])
    for r in (1, 2):
        job.coll(r, end, 7, shapes=[[10]], site="ddp/reducer.py:88", step=3, done=False, source="engine")
        job.hang(r, end + 5, step=3, inflight=[inflight(7, end, "ddp/reducer.py:88")])
    for r in range(3):
        job.heartbeat(r, end + 5.5, step=3, phase="idle" if r == 0 else "allreduce", last=6 if r == 0 else 7)
    return job, end + 6


def test_a_group_member_that_never_issued_on_the_group_is_the_missing_rank() -> None:
    job, now = subgroup_hang(with_members=True)
    incidents = diagnose(job.snapshot(), now)
    missing = {i.pg: i for i in incidents if i.kind == "missing_collective"}
    sub = missing["pg:1"]
    assert sub.culprit_ranks == [1] and sub.seq == 1 and sub.rank == 0
    assert "collective #1 of group pg:1; rank 1 never issued it" in sub.message
    assert "rank 1: no collective recorded" in sub.message
    assert missing["default"].culprit_ranks == [0]  # the consequence on the default group
    (hang0,) = [i for i in incidents if i.kind == "hang" and i.rank == 0]
    assert hang0.culprit_ranks == [1] and "never issued collective #1 of group pg:1" in hang0.message


def test_a_rank_outside_the_group_is_never_blamed_for_its_collectives() -> None:
    job, now = subgroup_hang(with_members=True)
    for i in diagnose(job.snapshot(), now):
        if i.pg == "pg:1":
            assert 2 not in i.culprit_ranks, i.message


def test_without_recorded_members_a_group_is_the_ranks_seen_on_it_as_before() -> None:
    job, now = subgroup_hang(with_members=False)
    incidents = diagnose(job.snapshot(), now)
    assert [i.pg for i in incidents if i.kind == "missing_collective"] == ["default"], kinds(incidents)


def test_a_member_that_completed_a_collective_with_its_peers_is_not_missing_from_it() -> None:
    # Rank 1's own records of pg:1 are lost (pruned, or still in its spool); rank 0 completed #1 with it.
    job = started(2)
    end = job.train(2)
    coll(job, 0, end, 1, pg="pg:1", op="all_reduce", reduce_op="SUM", group_ranks=[0, 1])
    coll(job, 0, end + 0.1, 2, pg="pg:1", op="all_reduce", reduce_op="SUM", group_ranks=[0, 1], done=False)
    job.hang(0, end + 5, step=2, phase="idle", inflight=[inflight(2, end + 0.1, pg="pg:1")])
    job.heartbeat(0, end + 5.5, step=2, phase="idle", last=4)
    job.heartbeat(1, end + 5.5, step=2, phase="forward", last=4)
    missing = only(diagnose(job.snapshot(), end + 6), "missing_collective")
    assert missing.pg == "pg:1" and missing.seq == 2 and missing.culprit_ranks == [1]
    assert "its peers completed #1 with it" in missing.message
