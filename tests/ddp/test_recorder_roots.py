"""The recorder's ``root`` (src/dst of rooted collectives) and ``group_ranks`` (members of a
non-default group), on a real single-rank gloo group in this process, and in real multi-rank jobs
whose ranks disagree on a root or skip a subgroup's collective, diagnosed by a real collector."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpscope.ddp import groups
from ddpscope.ddp.collectives import RECORDER
from tests.ddp import test_collectives_recorder as base
from tests.ddp.test_collectives_recorder import Records
from tests.support.collector_proc import CollectorProc
from tests.support.procs import kill_group, started_ranks

JOB = Path(__file__).parent / "roots_job.py"

# The single-rank gloo group and the in-memory agent of the recorder's own tests.
gloo, records = base.gloo, base.records


def data_moves(records: Records) -> list[dict[str, Any]]:
    """The collectives recorded, but ``new_group`` (itself a collective of the default group)."""
    return [r for r in records("collective") if r["op"] != "new_group"]


def by_op(begun: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["op"]: r for r in begun}


def test_rooted_collectives_record_their_root_and_others_record_none(records: Records) -> None:
    t = torch.ones(4)
    dist.broadcast(t, src=0)
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    dist.gather(t, [torch.zeros(4)], dst=0)
    dist.scatter(t, [torch.ones(4)], src=0)
    dist.all_reduce(t)
    dist.barrier()
    begun = by_op(records("collective"))
    assert {op: r.get("root") for op, r in begun.items()} == {
        "broadcast": 0, "reduce": 0, "gather": 0, "scatter": 0, "all_reduce": None, "barrier": None,
    }  # fmt: skip
    # No key at all where there is no root, and none of the default group's members: nothing to send.
    assert "root" not in begun["all_reduce"] and "root" not in begun["barrier"]
    assert not any("group_ranks" in r for r in begun.values())
    assert begun["reduce"]["reduce_op"] == "MAX"


def test_a_root_given_by_position_or_as_a_group_rank_is_recorded_as_a_global_rank(records: Records) -> None:
    sub = dist.new_group([0])
    t = torch.ones(4)
    dist.broadcast(t, 0)
    dist.broadcast(t, group=sub, group_src=0)
    dist.reduce(t, None, dist.ReduceOp.SUM, sub, False, 0)  # group_dst by position
    begun = data_moves(records)
    assert [(r["pg"], r["op"], r["root"]) for r in begun] == [
        ("default", "broadcast", 0), (groups.pg_name(sub), "broadcast", 0), (groups.pg_name(sub), "reduce", 0),
    ]  # fmt: skip


def test_every_collective_of_a_subgroup_carries_its_members(records: Records) -> None:
    sub = dist.new_group([0])
    t = torch.ones(4)
    dist.all_reduce(t, group=sub)
    dist.all_reduce(t)
    dist.barrier(group=sub)
    begun = data_moves(records)
    assert [(r["pg"], r.get("group_ranks")) for r in begun] == [
        (groups.pg_name(sub), [0]), ("default", None), (groups.pg_name(sub), [0]),
    ]  # fmt: skip


def test_the_engines_collectives_on_a_subgroup_carry_its_members_once_pg_name_has_seen_it(
    records: Records,
) -> None:
    sub = dist.new_group([0])
    pg = groups.pg_name(sub)  # what the engine does at construction
    RECORDER.reset()  # numbering restarts; the members stay known
    seq = RECORDER.begin(pg, "all_reduce", [torch.ones(2)], reduce_op="SUM", source="engine", step=0)
    RECORDER.end(pg, seq)
    (begun,) = data_moves(records)
    assert begun["pg"] == pg and begun["group_ranks"] == [0] and "root" not in begun


# ------------------------------------------------------------------------------- real jobs, real collector

WAIT_S = 90.0
"""Deadline for a diagnosis to show up (both jobs run at once on a 2-core machine)."""


def site(name: str) -> str:
    for number, line in enumerate(JOB.read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"# SITE:{name}"):
            return f"{JOB.name}:{number}"
    raise KeyError(name)


def incidents(url: str, job: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/jobs/{job}/incidents", timeout=10) as resp:
        return list(json.loads(resp.read())["items"])


def wait_for(
    url: str, job: str, procs: list[subprocess.Popen[str]], found: Callable[[list[dict[str, Any]]], Any]
) -> Any:
    deadline = time.monotonic() + WAIT_S
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            seen = incidents(url, job)
            result = found(seen)
            if result:
                return result
        time.sleep(0.5)
    logs = ""
    for rank, p in enumerate(procs):
        kill_group(p)
        with contextlib.suppress(Exception):
            logs += f"--- rank {rank} rc={p.returncode}\n{p.communicate(timeout=10)[1][-2500:]}\n"
    raise AssertionError(f"not diagnosed within {WAIT_S} s; incidents: {seen}\n{logs}")


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("roots-jobs")
    with CollectorProc(f"sqlite:///{tmp / 'ddpscope.db'}", log_path=tmp / "collector.log") as proc:
        yield proc.start(), tmp


@contextlib.contextmanager
def job(
    collector: tuple[str, Path], scenario: str, world: int
) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    """Start ``scenario`` on ``world`` ranks streaming to the collector; every rank is killed by pid
    (its process group) when the block ends, hung or not."""
    url, tmp = collector
    job_id = f"{scenario}-{uuid.uuid4().hex[:6]}"
    env = {
        "DDPSCOPE_URL": url,
        "DDPSCOPE_JOB": job_id,
        "DDPSCOPE_HANG_TIMEOUT": "1",
        "DDPSCOPE_HEARTBEAT_S": "0.5",
        "DDPSCOPE_SPOOL_DIR": str(tmp / "spool" / job_id),
        "JOB_PG_TIMEOUT_S": "40",
    }
    with started_ranks(JOB, world, args=[scenario], env=env) as procs:
        yield job_id, procs


def diagnosed(
    collector: tuple[str, Path],
    scenario: str,
    world: int,
    pick: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``scenario`` until ``pick`` finds exactly one incident: that one, and every incident then."""
    url = collector[0]
    with job(collector, scenario, world) as (job_id, procs):
        (found,) = wait_for(url, job_id, procs, pick)
        return found, incidents(url, job_id)


@pytest.mark.slow
def test_a_real_broadcast_where_each_rank_names_itself_src_is_a_mismatch_naming_both_srcs(
    collector: tuple[str, Path],
) -> None:
    url = collector[0]
    with job(collector, "bcast_src", 2) as (job_id, procs):
        (m,) = wait_for(url, job_id, procs, lambda inc: [i for i in inc if i["kind"] == "mismatch"])
    at = m["call_site"]  # relative to the ranks' working directory
    assert m["seq"] == 4 and m["culprit_ranks"] == [1] and at.endswith(site("bcast")), m
    # One line, run with src=rank on each rank: the line is at fault, and each rank named itself.
    assert m["message"].startswith(
        f"Every rank issued broadcast at {at} as collective #4 of group default (rank 0: broadcast(src=0) [8] "
        "float32; rank 1: broadcast(src=1) [8] float32): one line, run with a root that depends on the rank"
    ), m
    assert "roots differ (src)" in m["message"] and "each rank passed its own rank" in m["message"], m


@pytest.mark.slow
def test_a_real_monitored_barrier_one_rank_skips_blames_that_rank_from_the_barrier_and_from_torchs_error(
    collector: tuple[str, Path],
) -> None:
    def named(inc: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [i for i in inc if i["kind"] == "rank_error" and "monitoredBarrier" in i["message"]]

    err, found = diagnosed(collector, "monitored", 3, named)
    assert err["culprit_ranks"] == [2] and err["rank"] == 0, err
    assert "The cause is on rank 2" in err["message"], err
    (m,) = [i for i in found if i["kind"] == "mismatch"]
    assert m["culprit_ranks"] == [2] and m["seq"] == 4, m
    assert "ranks 0, 1 issued monitored_barrier at" in m["message"] and site("monitored") in m["message"], m


@pytest.mark.slow
def test_a_real_subgroup_collective_one_member_never_issues_is_a_deadlock_blamed_on_its_caller(
    collector: tuple[str, Path],
) -> None:
    # Rank 0 waits in the subgroup's all-reduce for rank 1; rank 1 waits in the default group's next
    # all-reduce for rank 0 (with rank 2): one cycle, not two missing collectives blaming each other.
    m, found = diagnosed(collector, "subgroup", 3, lambda inc: [i for i in inc if i["kind"] == "mismatch"])
    # Once the cycle is known, nothing blames rank 1, the victim.
    assert m["culprit_ranks"] == [0] and (m["pg"], m["seq"]) == ("pg:1", 1), m
    assert m["message"].startswith("Deadlock across process groups") and m["call_site"].endswith(
        site("sub")
    ), m
    assert "Rank 1 has never issued any collective on group pg:1" in m["message"], m
    assert all(1 not in i["culprit_ranks"] for i in found), found


@pytest.mark.slow
def test_a_real_rank_slow_before_the_engine_is_built_is_blamed_by_the_ranks_waiting_for_it_through_rank_0(
    collector: tuple[str, Path],
) -> None:
    # Rank 2 waits in the clock sync for rank 0, which serves the ranks in turn and waits for rank 1
    # first: rank 0 "entered late" from rank 2's side, but it was held up itself.
    def of_rank_2(inc: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            i for i in inc if i["kind"] == "hang" and i["rank"] == 2 and i["message"].startswith("(resolved)")
        ]

    hang, found = diagnosed(collector, "slow_setup", 3, of_rank_2)
    assert hang["culprit_ranks"] == [1], hang
    assert "ddpscope's start-up clock sync" in hang["message"] and "holding up rank 0" in hang["message"], (
        hang
    )
    assert hang["call_site"].endswith(site("engine")), hang
    assert all(i["culprit_ranks"] == [1] for i in found if i["kind"] == "hang"), found
