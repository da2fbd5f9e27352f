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


def test_one_line_broadcasting_from_each_rank_s_own_rank_blames_the_line_and_the_per_rank_src() -> None:
    job = started(2)
    end = job.train(3)  # seqs 1..6
    for r in (0, 1):  # broadcast_object_list(cfg, src=rank): both wait until the timeout on gloo
        coll(job, r, end, 7, root=r, done=False)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.seq == 7 and m.pg == "default" and m.call_site == "train.py:64"
    assert m.culprit_ranks == [1]  # an even split: rank 0's call is the reference
    assert m.message.startswith(
        "Every rank issued broadcast at train.py:64 as collective #7 of group default (rank 0: broadcast(src=0) "
        "[8] float32; rank 1: broadcast(src=1) [8] float32): one line, run with a root that depends on the rank"
    )
    assert "The roots differ (src)" in m.message and "timeout" in m.message
    assert "each rank passed its own rank, so every rank took itself for the root" in m.message
    assert "same collectives in the same order" not in m.message  # they did issue the same one


def test_one_line_with_a_root_from_a_per_host_setting_blames_the_line_without_saying_own_rank() -> None:
    job = started(3)
    end = job.train(2)
    for r in range(3):
        coll(job, r, end, 5, root=0 if r < 2 else 1)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.culprit_ranks == [2] and "one line, run with a root that depends on the rank" in m.message
    assert "its own rank" not in m.message and "Every rank must pass the same root" in m.message


def test_the_odd_root_among_three_ranks_is_the_culprit() -> None:
    job = started(3)
    end = job.train(2)
    for r in range(3):
        coll(job, r, end, 5, op="scatter", root=2 if r == 2 else 0)
    m = only(diagnose(job.snapshot(), end + 0.5), "mismatch")
    assert m.culprit_ranks == [2]
    assert "ranks 0, 1: scatter(src=0)" in m.message and "rank 2: scatter(src=2)" in m.message
    assert "Rank 2 had the odd roots" in m.message


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
        stuck_in_bucket_all_reduce(job, r, end, 7, step=3)
    for r in range(3):
        job.heartbeat(r, end + 5.5, step=3, phase="idle" if r == 0 else "allreduce", last=6 if r == 0 else 7)
    return job, end + 6


def test_a_subgroup_call_one_member_never_makes_while_it_waits_in_the_default_group_is_a_deadlock_on_the_caller() -> (
    None
):
    job, now = subgroup_hang(with_members=True)
    incidents = diagnose(job.snapshot(), now)
    (deadlock,) = [i for i in incidents if i.kind == "mismatch"]
    assert deadlock.culprit_ranks == [0] and (deadlock.pg, deadlock.seq) == ("pg:1", 1)
    assert deadlock.call_site == "train.py:80" and deadlock.message.startswith(
        "Deadlock across process groups"
    )
    assert (
        "rank 0 waits in all_reduce(SUM) [8] float32 at train.py:80, collective #1 of group pg:1 (ranks 0, 1) "
        "for rank 1" in (deadlock.message)
    )
    # The group's members are said once, where the message first names it, and on the incident.
    assert deadlock.message.count("(ranks 0, 1)") == 1 and deadlock.group_ranks == [0, 1]
    assert (
        "rank 1 waits in" in deadlock.message
        and "collective #7 of group default for rank 0" in deadlock.message
    )
    assert "Rank 1 has never issued any collective on group pg:1" in deadlock.message
    # The two waits are one story: no missing collective on pg:1 blaming rank 1, the victim.
    missing = {i.pg: i for i in incidents if i.kind == "missing_collective"}
    assert list(missing) == ["default"] and missing["default"].culprit_ranks == [0]
    assert "it is blocked itself, in all_reduce(SUM) [8] float32 at train.py:80" in missing["default"].message
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert all(h.culprit_ranks == [0] for h in hangs.values()), [h.message for h in hangs.values()]
    assert "this rank is at fault" in hangs[0].message and "a deadlock" in hangs[0].message


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


# ------------------------------------------------------------------------------------- chains of waits


def group_all_reduce(
    job: JobRecords,
    rank: int,
    t: float,
    seq: int,
    *,
    pg: str,
    members: list[int],
    site: str,
    done: bool = True,
) -> None:
    """A user all_reduce(SUM) [8] float32 on a subgroup (the record carries its members)."""
    coll(
        job,
        rank,
        t,
        seq,
        pg=pg,
        op="all_reduce",
        reduce_op="SUM",
        call_site=site,
        group_ranks=members,
        done=done,
    )


def stuck_in_bucket_all_reduce(job: JobRecords, rank: int, t: float, seq: int, *, step: int) -> None:
    """The engine's bucket all-reduce #seq on the default group, started at ``t``, with the hang report."""
    job.coll(rank, t, seq, shapes=[[10]], site="ddp/reducer.py:88", step=step, done=False, source="engine")
    job.hang(rank, t + 5, step=step, inflight=[inflight(seq, t, "ddp/reducer.py:88")])


def test_a_rank_blocked_in_a_mismatched_broadcast_is_a_victim_and_the_odd_root_is_the_culprit_down_the_chain() -> (
    None
):
    # Roots 0, 0, 2: ranks 0 and 1 pair up and rank 1 goes on to the next all-reduce; rank 0 stays in the
    # broadcast waiting for rank 2, which thinks it is the root.
    job = started(3)
    end = job.train(3)  # default seqs 1..6
    for r in range(3):
        coll(job, r, end, 7, root=2 if r == 2 else 0, done=r == 1)
    stuck_in_bucket_all_reduce(job, 1, end + 0.1, 8, step=3)
    for r in (0, 2):
        job.hang(r, end + 5, step=3, phase="idle", inflight=[inflight(7, end, "train.py:64")])
    for r in range(3):
        job.heartbeat(r, end + 5.5, step=3, phase="idle", last=8 if r == 1 else 7)
    incidents = diagnose(job.snapshot(), end + 6)
    assert only(incidents, "mismatch").culprit_ranks == [2]
    missing = only(incidents, "missing_collective")
    assert missing.seq == 8 and missing.culprit_ranks == [2], missing.message
    assert "rank 0: last collective #7" in missing.message and "it is blocked itself" in missing.message
    assert "where the ranks disagree (see the mismatch)" in missing.message
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert {r: h.culprit_ranks for r, h in hangs.items()} == {0: [2], 1: [2], 2: [2]}
    assert "this rank is at fault" in hangs[2].message
    assert "rank 0 waits on it, blocked in broadcast(src=0)" in hangs[1].message


def test_ranks_that_each_wait_in_a_collective_the_other_also_makes_deadlock_in_a_different_order() -> None:
    # Both ranks use both groups every step; this time rank 0 went to pg:1 first, rank 1 to the default
    # group: neither call is odd, so both ranks are named.
    job = started(2)
    end = job.train(2)  # default seqs 1..4
    for s, t in enumerate((end - 0.2, end - 0.1), start=1):
        for r in (0, 1):
            group_all_reduce(job, r, t, s, pg="pg:1", members=[0, 1], site="train.py:80")
    group_all_reduce(job, 0, end, 3, pg="pg:1", members=[0, 1], site="train.py:80", done=False)
    job.hang(0, end + 5, step=2, phase="idle", inflight=[inflight(3, end, "train.py:80", pg="pg:1")])
    stuck_in_bucket_all_reduce(job, 1, end, 5, step=2)
    for r in (0, 1):
        job.heartbeat(r, end + 5.5, step=2, phase="idle" if r == 0 else "allreduce", last=4 if r == 0 else 5)
    incidents = diagnose(job.snapshot(), end + 6)
    deadlock = only(incidents, "mismatch")
    assert deadlock.culprit_ranks == [0, 1]
    assert "The ranks issue collectives on groups default, pg:1 in a different order" in deadlock.message
    assert "missing_collective" not in kinds(incidents)
    assert all(
        i.culprit_ranks == [0, 1] or i.culprit_ranks == [i.rank] for i in incidents if i.kind == "hang"
    )


def test_a_deadlock_stopped_by_sigterm_keeps_its_diagnosis_in_the_post_mortem() -> None:
    # The same subgroup deadlock, then the launcher's timeout stops every rank: read hours later, the
    # wait graph is the one of the moment they were stopped, not "every rank issued it in time".
    job, now = subgroup_hang(with_members=True)
    live_kinds = kinds(diagnose(job.snapshot(), now))
    for r in range(3):
        job.exit(r, now + 1, reason="sigterm", step=3)
    later = now + 3 * 3600
    incidents = diagnose(job.snapshot(), later)
    assert kinds(incidents) == live_kinds
    (deadlock,) = [i for i in incidents if i.kind == "mismatch"]
    assert deadlock.culprit_ranks == [0] and deadlock.message.startswith("Deadlock across process groups")
    hangs = [i for i in incidents if i.kind == "hang"]
    assert hangs and all(h.culprit_ranks == [0] for h in hangs), [h.message for h in hangs]
    assert not any("in time" in h.message for h in hangs)
    (missing,) = [i for i in incidents if i.kind == "missing_collective"]
    assert "it is blocked itself, in all_reduce(SUM) [8] float32 at train.py:80" in missing.message
    waited = float(missing.message.split(" have waited ")[1].split(" s ")[0])
    assert waited < 60  # until the stop, not until the reading


def test_a_wait_on_a_rank_blocked_in_another_group_blames_the_rank_at_the_end_of_the_chain() -> None:
    # Rank 0 waits in the default group for rank 1; rank 1 waits in pg:1 for rank 2, which went on
    # doing something else: rank 2 holds both up.
    job = started(3)
    end = job.train(2)  # default seqs 1..4
    stuck_in_bucket_all_reduce(job, 0, end, 5, step=2)
    group_all_reduce(job, 1, end, 1, pg="pg:2", members=[1, 2], site="train.py:90", done=False)
    job.hang(1, end + 5, step=2, phase="idle", inflight=[inflight(1, end, "train.py:90", pg="pg:2")])
    for r in range(3):
        job.heartbeat(r, end + 5.5, step=2, phase="forward" if r == 2 else "idle", last=5 if r == 0 else 4)
    incidents = diagnose(job.snapshot(), end + 6)
    assert "mismatch" not in kinds(incidents)
    missing = {i.pg: i for i in incidents if i.kind == "missing_collective"}
    assert missing["default"].culprit_ranks == [2] and missing["pg:2"].culprit_ranks == [2]
    assert "Rank 2 holds them all up" in missing["default"].message
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [2] and hangs[1].culprit_ranks == [2]
    assert "rank 1 waits on it, blocked in all_reduce(SUM) [8] float32 at train.py:90" in hangs[0].message


def test_a_later_async_all_reduce_behind_a_mismatched_collective_is_not_a_deadlock_nor_a_missing_collective() -> (
    None
):
    # Ranks 0 and 1 wait in a monitored_barrier rank 2 skipped; rank 2 is in its bucket all-reduce #7 and
    # has #8 in flight behind it: #8 lacks ranks 0 and 1, but rank 2 is blocked in #7, not in #8.
    job = started(3)
    end = job.train(3)  # default seqs 1..6
    for r in (0, 1):
        coll(job, r, end, 7, op="monitored_barrier", shapes=[], call_site="train.py:70", done=False)
        job.hang(r, end + 5, step=3, phase="idle", inflight=[inflight(7, end, "train.py:70")])
    for seq, t in ((7, end), (8, end + 0.01)):
        job.coll(2, t, seq, shapes=[[10]], site="ddp/reducer.py:88", step=3, done=False, source="engine")
    job.hang(
        2,
        end + 5,
        step=3,
        inflight=[inflight(7, end, "ddp/reducer.py:88"), inflight(8, end + 0.01, "ddp/reducer.py:88")],
    )
    for r in range(3):
        job.heartbeat(r, end + 5.5, step=3, phase="idle" if r < 2 else "allreduce", last=8 if r == 2 else 7)
    incidents = diagnose(job.snapshot(), end + 6)
    (m,) = [i for i in incidents if i.kind == "mismatch"]
    assert m.culprit_ranks == [2] and m.seq == 7 and "The ops differ:" in m.message, m.message
    assert "missing_collective" not in kinds(incidents), [i.message for i in incidents]
    assert all(i.culprit_ranks == [2] for i in incidents if i.kind == "hang")


def test_a_deadlock_between_groups_created_in_different_orders_names_the_creation_order() -> None:
    # Rank 0 made a (line 8) then b (line 10), rank 1 b then a: torch pairs rank 0's a with rank 1's b.
    job = started(2)
    end = job.train(2)  # default seqs 1..4
    for r, sites in ((0, ("sg.py:8", "sg.py:10")), (1, ("sg.py:10", "sg.py:8"))):
        for seq, site in zip((5, 6), sites, strict=True):
            job.coll(r, end, seq, op="new_group", reduce_op=None, shapes=[[0, 1]], dtypes=[], site=site)
    group_all_reduce(job, 0, end + 0.1, 1, pg="pg:1", members=[0, 1], site="sg.py:17", done=False)
    group_all_reduce(job, 1, end + 0.1, 1, pg="pg:2", members=[0, 1], site="sg.py:17", done=False)
    job.hang(0, end + 5, step=2, phase="idle", inflight=[inflight(1, end + 0.1, "sg.py:17", pg="pg:1")])
    job.hang(1, end + 5, step=2, phase="idle", inflight=[inflight(1, end + 0.1, "sg.py:17", pg="pg:2")])
    incidents = diagnose(job.snapshot(), end + 6)
    deadlock = next(i for i in incidents if i.kind == "mismatch" and i.message.startswith("Deadlock"))
    assert "The ranks created their groups in different orders (see the mismatch at collective #5" in (
        deadlock.message
    )
    assert "Create the groups in the same order on every rank." in deadlock.message
    assert "Issue the collectives of groups" not in deadlock.message
