"""What the engine emits: every record valid on the wire, consistent with the collectives it issued,
and on one aligned clock."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ddpscope.agent.records import validate_record
from tests.ddp.engine_jobs import run_job

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job("compare.py", 2, ["mlp,unused,no_sync", str(STEPS)], tmp_path_factory.mktemp("records"))


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


def test_every_record_the_engine_emits_passes_the_wire_format(ranks: list[dict[str, Any]]) -> None:
    kinds = set()
    for rank in ranks:
        for scenario in rank.values():
            for record in scenario["records"]:
                kinds.add(validate_record(record))
                assert record["rank"] == scenario["rank"]
    # The agent adds its own accounting (agent_stats); the engine's kinds must all be there.
    assert {"rank_start", "layout", "step", "collective", "collective_end"} <= kinds


def test_rank_start_reports_the_configuration_and_a_clock_estimate_within_its_error(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        (start,) = of_kind(rank["unused"]["records"], "rank_start")
        assert start["engine"] == "ddpscope" and start["world_size"] == 2 and start["backend"] == "gloo"
        assert start["find_unused_parameters"] is True and start["bucket_cap_mb"] == 25.0
        # What the collector needs to tell a host with more threads than cores (ranks run OMP_NUM_THREADS=1).
        assert start["threads"] == 1 and start["host_cpus"] == os.cpu_count() and start["cpus_allowed"] >= 1
        assert start["check_gradients"] is False
        if rank["unused"]["rank"] == 0:
            assert (start["clock_offset_ns"], start["clock_error_ns"]) == (0, 0)
        else:
            # Both ranks read the same kernel clock, so the true offset is 0: the estimate must be
            # within its own error bound (half the best round trip).
            assert start["clock_error_ns"] > 0
            assert abs(start["clock_offset_ns"]) <= start["clock_error_ns"] + 1


def test_buckets_are_rebuilt_once_after_the_first_iteration_unless_finding_unused_parameters(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        layouts = of_kind(rank["mlp"]["records"], "layout")
        assert [(r["reason"], r["step"]) for r in layouts] == [("initial", 0), ("rebuilt", 1)]
        rebuilt = layouts[1]["buckets"]
        # Gradients arrive output layer first: the rebuilt order starts there.
        assert rebuilt[0]["parameters"][0].startswith("layers.4")
        unused = of_kind(rank["unused"]["records"], "layout")
        assert [r["reason"] for r in unused] == ["initial"]


def test_one_step_record_per_iteration_with_times_in_causal_order(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        steps = of_kind(rank["mlp"]["records"], "step")
        assert [s["step"] for s in steps] == list(range(STEPS))
        for s in steps:
            assert s["synced"] is True
            assert (
                s["forward_start_ns"] <= s["forward_end_ns"] <= s["backward_start_ns"] <= s["backward_end_ns"]
            )
            n = len(s["bucket_bytes"])
            assert n >= 1 and sorted(s["ready_order"]) == list(range(n))
            for b in range(n):
                assert s["backward_start_ns"] <= s["bucket_ready_ns"][b] <= s["allreduce_start_ns"][b]
                assert s["allreduce_start_ns"][b] <= s["allreduce_end_ns"][b] <= s["backward_end_ns"]


def test_step_records_name_the_collectives_they_used(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        records = rank["mlp"]["records"]
        collectives = {(c["pg"], c["coll_seq"]): c for c in of_kind(records, "collective")}
        ended = {(c["pg"], c["coll_seq"]) for c in of_kind(records, "collective_end") if c["ok"]}
        for s in of_kind(records, "step"):
            for seq in s["collective_seqs"]:
                c = collectives[("default", seq)]
                assert (c["op"], c["reduce_op"], c["source"], c["step"]) == (
                    "all_reduce",
                    "SUM",
                    "engine",
                    s["step"],
                )
                assert ("default", seq) in ended

    # Both ranks numbered the default group's collectives identically.
    def default_ops(rank: dict[str, Any]) -> list[tuple[int, str]]:
        return [
            (c["coll_seq"], c["op"])
            for c in of_kind(rank["mlp"]["records"], "collective")
            if c["pg"] == "default"
        ]

    assert default_ops(ranks[0]) == default_ops(ranks[1])


def test_no_sync_steps_are_recorded_unsynced_without_collectives(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        steps = of_kind(rank["no_sync"]["records"], "step")
        assert [s["synced"] for s in steps] == [False, False, True] * STEPS
        for s in steps:
            if not s["synced"]:
                assert s["collective_seqs"] == [] and s["bucket_ready_ns"] == []


def test_unused_parameters_are_named_in_the_step_records(ranks: list[dict[str, Any]]) -> None:
    by_rank = {rank["unused"]["rank"]: of_kind(rank["unused"]["records"], "step") for rank in ranks}
    for s in by_rank[0]:
        assert s["unused_parameters"] == ["never.weight", "never.bias"]
    for s in by_rank[1]:
        assert s["unused_parameters"] == ["branch.weight", "branch.bias", "never.weight", "never.bias"]
