"""Hosts whose ranks want more CPUs than they have (``server/analysis/host_load.py``): a straggler there says
that ranks sharing cores are slowed unevenly by the sharing, since the remedy is the host's load, not the rank."""

from __future__ import annotations

from typing import Any

from ddpscope.server.analysis.host_load import crowded_hosts, with_contention
from ddpscope.server.analysis.stragglers import Straggler


def start(
    rank: int, host: str = "node-1", *, cpus: int = 2, allowed: int | None = 2, threads: int = 1
) -> dict:
    record: dict[str, Any] = {
        "kind": "rank_start",
        "rank": rank,
        "host": host,
        "host_cpus": cpus,
        "threads": threads,
    }
    if allowed is not None:
        record["cpus_allowed"] = allowed
    return record


def straggler(rank: int, flagged: bool = True) -> Straggler:
    return Straggler(rank, 1.5, 15, 20, flagged, "backward", 1.0, 1.5, 1.0, 0.01)


def test_four_single_thread_ranks_on_two_cores_crowd_their_host() -> None:
    crowded = crowded_hosts([start(r) for r in range(4)])
    assert sorted(crowded) == [0, 1, 2, 3]
    host = crowded[2]
    assert (host.host, host.ranks, host.wanted, host.cpus) == ("node-1", (0, 1, 2, 3), 4, 2)
    assert host.note().startswith(
        "host node-1 runs 4 ranks wanting 4 CPUs on 2: ranks that share cores are slowed"
    )


def test_ranks_pinned_to_a_core_each_want_one_cpu_whatever_their_threads() -> None:
    assert crowded_hosts([start(r, cpus=4, allowed=1, threads=8) for r in range(4)]) == {}
    assert crowded_hosts([start(r, cpus=4, allowed=1, threads=8) for r in range(5)]) != {}


def test_threads_per_rank_count_and_only_the_crowded_host_is_named() -> None:
    starts = [start(r, "a", cpus=16, allowed=16, threads=8) for r in range(4)]  # 32 threads on 16 CPUs
    starts += [start(r, "b", cpus=16, allowed=16, threads=4) for r in range(4, 8)]  # 16 on 16: fine
    crowded = crowded_hosts(starts)
    assert sorted(crowded) == [0, 1, 2, 3] and crowded[0].wanted == 32


def test_agents_without_the_fields_say_nothing() -> None:
    assert crowded_hosts([{"kind": "rank_start", "rank": r, "host": "node-1"} for r in range(4)]) == {}


def test_only_a_flagged_straggler_on_a_crowded_host_carries_the_note() -> None:
    found = with_contention(
        [straggler(0), straggler(1, flagged=False), straggler(5)],
        [start(0), start(1), start(2), start(5, "roomy", cpus=64, allowed=64)],
    )
    assert (
        found[0].contention is not None
        and "host node-1 runs 3 ranks wanting 3 CPUs on 2" in found[0].contention
    )
    assert found[1].contention is None and found[2].contention is None
