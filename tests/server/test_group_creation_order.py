"""``torch.distributed.new_group`` called in different orders on different ranks. torch tells groups apart by the
order of these calls, which every rank of the world makes, members or not; the recorder numbers each call as a
collective of the default group (``op`` 'new_group', its member ranks as its one shape), so a group created out
of order is a mismatch at one sequence number. The real 2-rank job is in
``tests/ddp/test_collectives_jobs.py``."""

from __future__ import annotations

from ddpscope.server.analysis.incidents import diagnose
from tests.server.test_incidents import JobRecords, inflight, only, started


def new_group(
    job: JobRecords, rank: int, t: float, seq: int, members: list[int], site: str, *, done: bool
) -> None:
    job.coll(rank, t, seq, op="new_group", reduce_op=None, shapes=[members], dtypes=[], site=site, done=done)


def test_groups_of_different_ranks_created_in_different_orders_name_both_lines_and_the_rule() -> None:
    job = started(2)
    end = job.train(2)  # default #1..#4
    # Rank 0: new_group([0, 1]) then new_group([0]); rank 1 the other way round. Both wait to connect.
    new_group(job, 0, end, 5, [0, 1], "train.py:61", done=False)
    new_group(job, 1, end, 5, [0], "train.py:63", done=False)
    for rank, site in ((0, "train.py:61"), (1, "train.py:63")):
        flight = {
            **inflight(5, end, site),
            "op": "new_group",
            "shapes": [[0, 1] if rank == 0 else [0]],
            "dtypes": [],
        }
        job.hang(rank, end + 5, step=2, inflight=[flight], phase="idle")
        job.heartbeat(rank, end + 5, step=2, phase="idle", last=4)
    m = only(diagnose(job.snapshot(), end + 5.5), "mismatch")
    assert m.seq == 5 and m.pg == "default"
    assert "new_group(ranks=[0, 1]) at train.py:61" in m.message
    assert "new_group(ranks=[0]) at train.py:63" in m.message
    assert "created their process groups in different orders" in m.message
    assert "each rank waits to connect a group its peers never create" in m.message
    assert sorted(m.call_site.split(", ")) in (["train.py:61"], ["train.py:63"])


def test_groups_of_the_same_ranks_created_in_different_orders_are_said_to_pair_the_wrong_groups() -> None:
    job = started(2)
    end = job.train(2)
    new_group(job, 0, end, 5, [0, 1], "train.py:70", done=True)
    new_group(job, 0, end + 0.01, 6, [0, 1], "train.py:71", done=True)
    new_group(job, 1, end, 5, [0, 1], "train.py:71", done=True)
    new_group(job, 1, end + 0.01, 6, [0, 1], "train.py:70", done=True)
    m = only(diagnose(job.snapshot(), end + 0.1), "mismatch")
    assert m.seq == 5
    assert "created their process groups in different orders" in m.message
    assert "torch pairs one rank's group with the other's" in m.message


def test_every_rank_creating_the_same_groups_in_the_same_order_is_no_incident() -> None:
    job = started(2)
    end = job.train(2)
    for rank in (0, 1):
        new_group(job, rank, end, 5, [0, 1], "train.py:70", done=True)
        new_group(job, rank, end + 0.01, 6, [0], "train.py:71", done=True)
    assert diagnose(job.snapshot(), end + 0.1) == []


def test_the_rank_that_went_on_past_the_out_of_order_group_is_blamed_by_its_peers_wait_not_the_waiting_rank() -> (
    None
):
    job = started(2)
    end = job.train(2)
    # Rank 1 is no member of [0]: it got past #5 and waits at #6 for a group of both, which rank 0 never
    # reaches: rank 0 waits at #5 for rank 1 to connect its group of both.
    new_group(job, 0, end, 5, [0, 1], "train.py:61", done=False)
    new_group(job, 1, end, 5, [0], "train.py:63", done=True)
    new_group(job, 1, end + 0.01, 6, [0, 1], "train.py:64", done=False)
    at_5 = {**inflight(5, end, "train.py:61"), "op": "new_group", "shapes": [[0, 1]], "dtypes": []}
    at_6 = {**inflight(6, end + 0.01, "train.py:64"), "op": "new_group", "shapes": [[0, 1]], "dtypes": []}
    for rank, flight in ((0, at_5), (1, at_6)):
        job.hang(rank, end + 5, step=2, inflight=[flight], phase="idle")
        job.heartbeat(rank, end + 5, step=2, phase="idle", last=4)
    incidents = diagnose(job.snapshot(), end + 5.5)
    assert only(incidents, "mismatch").culprit_ranks == [1]
    missing = only(incidents, "missing_collective")
    assert missing.seq == 6 and missing.culprit_ranks == [1], missing
    assert (
        "Rank 1 waits for what it caused: it issued a different collective at #5 of group default (see the "
        "mismatch incident) and went on to this one" in missing.message
    ), missing.message
    hangs = {i.rank: i for i in incidents if i.kind == "hang"}
    assert hangs[0].culprit_ranks == [1] and "issued a different collective at #5" in hangs[0].message
    assert hangs[1].culprit_ranks == [1] and "this rank is at fault" in hangs[1].message
