"""The collective recorder in real 2-rank gloo jobs: the records show where ranks diverge."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ddp.failure_jobs.runner import run_job, site
from tests.support.procs import exited_cleanly

pytestmark = pytest.mark.slow


def test_a_user_all_reduce_on_one_rank_only_shows_as_a_higher_inflight_seq_on_that_rank(
    tmp_path: Path,
) -> None:
    run = run_job("extra", tmp_path, env={"DDPSCOPE_HANG_TIMEOUT": "1.0", "JOB_STALL_S": "3.0"})
    assert run.results[0].returncode == 0, run.output()
    assert run.results[1].returncode not in (0, None), run.output()  # its extra all-reduce failed
    last = {rank: max(r["coll_seq"] for r in run.of(rank, "collective")) for rank in (0, 1)}
    assert last == {0: 2, 1: 3}
    (hang,) = run.of(1, "hang")
    (inflight,) = hang["inflight"]
    assert inflight["coll_seq"] == 3 and inflight["call_site"].endswith(site("extra"))
    assert "default#3 all_reduce" in hang["message"]
    (failed,) = [r for r in run.of(1, "collective_end") if r["coll_seq"] == 3]
    assert failed["ok"] is False and failed["error"]
    (err,) = run.of(1, "rank_error")
    assert err["fatal"] is True and "extra" in err["stack"]


def test_same_shape_collectives_in_a_different_order_show_different_call_sites_at_the_same_seq(
    tmp_path: Path,
) -> None:
    run = run_job("order", tmp_path)
    assert all(exited_cleanly(r) for r in run.results), run.output()

    def at(rank: int, seq: int) -> dict[str, object]:
        (record,) = [r for r in run.of(rank, "collective") if r["coll_seq"] == seq]
        return record

    for seq in (1, 2):
        a, b = at(0, seq), at(1, seq)
        # gloo completes both silently: shapes and ops agree, only the call sites tell them apart.
        assert (a["op"], a["shapes"], a["dtypes"]) == (b["op"], b["shapes"], b["dtypes"])
        assert a["call_site"] != b["call_site"]
    assert str(at(0, 1)["call_site"]).endswith(site("reduce_a"))
    assert str(at(1, 1)["call_site"]).endswith(site("reduce_b"))


def test_a_healthy_torch_ddp_job_records_every_user_collective_and_reports_nothing_wrong(
    tmp_path: Path,
) -> None:
    run = run_job("healthy", tmp_path, env={"DDPSCOPE_HANG_TIMEOUT": "30", "DDPSCOPE_HEARTBEAT_S": "0.5"})
    assert all(exited_cleanly(r) for r in run.results), run.output()
    for rank in (0, 1):
        assert "internal_errors=0" in run.results[rank].stdout
        assert run.of(rank, "hang") == [] and run.of(rank, "rank_error") == []
        begun = run.of(rank, "collective")
        assert [(r["coll_seq"], r["op"]) for r in begun] == [(i, "all_reduce") for i in range(1, 11)]
        assert all(r["call_site"].endswith(site("loss" if i % 2 else "fire")) for i, r in enumerate(begun, 1))
        # The unwaited async ones end when the recorder sees them completed (the last may not be seen).
        ends = run.of(rank, "collective_end")
        assert len(ends) >= 9 and all(r["ok"] for r in ends)
        assert run.of(rank, "heartbeat")
        # Reading a Work's outcome must not print torch's deprecation warning into the user's log.
        assert "deprecated" not in run.results[rank].stderr, run.output()


def test_mismatched_sizes_abort_one_rank_and_the_survivor_records_the_sizes_it_issued(tmp_path: Path) -> None:
    run = run_job("mismatch", tmp_path, env={"JOB_STALL_S": "5"})
    codes = sorted(r.returncode for r in run.results if r.returncode is not None)
    assert -6 in codes, run.output()  # gloo's enforce aborts the receiving process (SIGABRT)
    survivor = next(r.rank for r in run.results if r.returncode != -6)
    (last,) = [r for r in run.of(survivor, "collective") if r["coll_seq"] == 4]
    assert last["shapes"] == ([[8]] if survivor == 0 else [[16]])
    assert last["call_site"].endswith(site("mismatch"))
    (failed,) = [r for r in run.of(survivor, "collective_end") if r["coll_seq"] == 4]
    assert failed["ok"] is False and "Connection" in (failed["error"] or "")
    assert run.of(survivor, "rank_error")[0]["fatal"] is True


def test_destroyed_groups_are_let_go_so_their_sockets_and_threads_close(tmp_path: Path) -> None:
    run = run_job("groups", tmp_path)
    assert all(exited_cleanly(r) for r in run.results), run.output()
    for rank in (0, 1):
        lines = dict(line.split(" ", 1) for line in run.results[rank].stdout.splitlines() if " fds=" in line)
        # Each group held after torch destroyed it kept ~5 descriptors and 3 threads open.
        assert lines["after"] == lines["before"], lines
        begun = [r for r in run.of(rank, "collective") if r["call_site"].endswith(site("group_all_reduce"))]
        assert len({r["pg"] for r in begun}) == 20 and {r["coll_seq"] for r in begun} == {1}


def test_groups_made_again_after_the_world_was_destroyed_are_numbered_from_one_on_every_rank(
    tmp_path: Path,
) -> None:
    run = run_job("regroup", tmp_path)
    assert all(exited_cleanly(r) for r in run.results), run.output()

    def issued(rank: int, name: str) -> list[tuple[str, int]]:
        return [
            (r["pg"], r["coll_seq"])
            for r in run.of(rank, "collective")
            if r["call_site"].endswith(site(name))
        ]

    assert issued(0, "solo_all_reduce") == [("pg:1", 1), ("pg:1", 2), ("pg:1", 3)]
    for rank in (0, 1):
        # Each new_group is a collective of the world, which every rank makes: default #1 of each generation.
        assert issued(rank, "first_world_all_reduce") == [("default", 2)]
        # torch named the new pair group as the destroyed solo group: rank 0 must not go on from #3 there
        # while rank 1, never in the solo group, starts at #1.
        assert issued(rank, "pair_all_reduce") == [("pg:1", 1)]
        assert issued(rank, "second_world_all_reduce") == [("default", 2)]


def test_groups_created_in_a_different_order_show_different_members_at_the_same_default_seq(
    tmp_path: Path,
) -> None:
    run = run_job(
        "group_order", tmp_path, env={"DDPSCOPE_HANG_TIMEOUT": "1.0", "JOB_STALL_S": "4.0"}, timeout_s=60
    )

    def new_groups(rank: int) -> list[dict[str, object]]:
        return [r for r in run.of(rank, "collective") if r["op"] == "new_group"]

    first = {rank: new_groups(rank)[0] for rank in (0, 1)}
    for rank in (0, 1):  # numbered with the world's collectives, after the all-reduce before them
        assert (first[rank]["pg"], first[rank]["coll_seq"]) == ("default", 2), run.output()
    assert first[0]["shapes"] == [[0, 1]] and str(first[0]["call_site"]).endswith(site("group_pair"))
    assert first[1]["shapes"] == [[0]] and str(first[1]["call_site"]).endswith(site("group_solo"))
    for rank in (0, 1):  # the watchdog saw each rank wait in it, not in code of its own
        hangs = run.of(rank, "hang")
        assert hangs and any(f["op"] == "new_group" for f in hangs[0]["inflight"]), run.output()
