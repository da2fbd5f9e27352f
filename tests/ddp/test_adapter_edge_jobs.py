"""``instrument(torch DDP)`` at its edges, in real 2-rank gloo jobs (tests/ddp/adapter_jobs/edge_job.py):
gradient accumulation with ``no_sync()``, a second model in the process, a peer dying mid-hang."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from ddpscope.agent.records import validate_record
from tests.ddp.failure_jobs.runner import JobRun
from tests.support.procs import exited_cleanly, run_ranks

pytestmark = pytest.mark.slow

JOB = Path(__file__).parent / "adapter_jobs" / "edge_job.py"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    records = [json.loads(line) for line in lines]
    for record in records:
        validate_record(record)
    return records


def run(scenario: str, out: Path, env: dict[str, str] | None = None) -> JobRun:
    results = run_ranks(JOB, 2, args=[scenario, str(out)], env=env or {}, timeout_s=120)
    return JobRun(results, {rank: read_jsonl(out / f"rank{rank}.jsonl") for rank in (0, 1)})


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobRun, Path]:
    out = tmp_path_factory.mktemp("accumulate")
    job = run("accumulate", out)
    assert all(exited_cleanly(r) for r in job.results), job.output()
    return job, out


def result(out: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((out / f"rank{rank}.json").read_text()))


# -- no_sync() accumulation ------------------------------------------------------------------------


def test_buckets_rebuilt_in_a_no_sync_forward_are_learned_as_torch_logged_them(
    accumulated: tuple[JobRun, Path],
) -> None:
    job, out = accumulated
    for rank in (0, 1):
        logged = result(out, rank)["logged"]
        assert logged["has_rebuilt_buckets"] == 1
        sizes = [int(s) for s in logged["rebuilt_bucket_sizes"].split(",")]
        assert len(sizes) > 1  # the rebuild changed the layout: there is something to learn
        layouts = job.of(rank, "layout")
        assert layouts[-1]["reason"] == "rebuilt"
        assert [b["bytes"] for b in layouts[-1]["buckets"]] == sizes
        names = result(out, rank)["reducer_parameters"]
        assert [b["parameters"] for b in layouts[-1]["buckets"]] == [
            [names[int(i)] for i in group.split()]
            for group in logged["rebuilt_per_bucket_param_indices"].split(",")
        ]


def test_the_rebuilt_layout_applies_from_the_no_sync_step_that_rebuilt_it(
    accumulated: tuple[JobRun, Path],
) -> None:
    job, _ = accumulated
    for rank in (0, 1):
        # Step 3 is the first synced one (it records the gradient order), step 4's forward rebuilds.
        assert [(lay["reason"], lay["step"]) for lay in job.of(rank, "layout")] == [
            ("initial", 0),
            ("rebuilt", 4),
        ]


def test_every_synced_step_after_the_rebuild_reports_torchs_buckets(accumulated: tuple[JobRun, Path]) -> None:
    job, out = accumulated
    for rank in (0, 1):
        sizes = [int(s) for s in result(out, rank)["logged"]["rebuilt_bucket_sizes"].split(",")]
        synced = [r for r in job.of(rank, "step") if r["synced"]]
        assert [r["step"] for r in synced] == [3, 7, 11]
        assert len(synced[0]["bucket_bytes"]) == 1
        for record in synced[1:]:
            assert record["bucket_bytes"] == sizes
            assert len(record["collective_seqs"]) == len(sizes)
            assert all(record["allreduce_end_ns"])


# -- a second model --------------------------------------------------------------------------------


def test_a_second_model_in_the_same_job_takes_over_numbering_its_steps_on_from_the_first(
    tmp_path: Path,
) -> None:
    # A model built again (after unfreezing layers, after re-creating the process group): refusing it
    # raised into training; its steps starting from 0 again would have mixed with the first model's.
    job = run("takeover", tmp_path)
    assert all(exited_cleanly(r) for r in job.results), job.output()
    for rank in (0, 1):
        assert result(tmp_path, rank)["first_detached"]
        (warning,) = [w for w in result(tmp_path, rank)["warnings"] if "instrument() of another" in w]
        assert "now measures this one (from step 8 on)" in warning and "trains on unmeasured" in warning
        assert "instrument only the one to observe" in warning  # the GAN's case
        # The first model's 8 steps, the second's 4 numbered on; the first's 4 more after are not measured.
        assert [r["step"] for r in job.of(rank, "step")] == list(range(12))
        initial = [lay["step"] for lay in job.of(rank, "layout") if lay["reason"] == "initial"]
        assert initial == [0, 8]


def test_instrumenting_the_same_model_again_still_returns_it(accumulated: tuple[JobRun, Path]) -> None:
    _, out = accumulated
    assert result(out, 0)["again_is_same"] and result(out, 1)["again_is_same"]


def test_a_second_model_under_a_new_job_is_measured_alone_and_the_first_detached(
    accumulated: tuple[JobRun, Path],
) -> None:
    job, out = accumulated
    for rank in (0, 1):
        assert result(out, rank)["first_detached"]
        # The first job's records stop at the first model's 12 steps, one row per step.
        assert [r["step"] for r in job.of(rank, "step")] == list(range(12))
        second = read_jsonl(out / f"second{rank}.jsonl")
        assert [r["step"] for r in second if r["kind"] == "step"] == [0, 1, 2, 3]
        assert [r["kind"] for r in second if r["kind"] in ("rank_start", "layout")] == [
            "rank_start",
            "layout",
        ]
        # The first model kept training after the switch; none of it reached either job as a step,
        # and its bucket all-reduces went to torch's own group again, unrecorded.
        assert not [r for r in second if r["kind"] == "hang"]
        stepped = {seq for r in second if r["kind"] == "step" for seq in r["collective_seqs"]}
        recorded = {r["coll_seq"] for r in second if r["kind"] == "collective" and r["op"] == "all_reduce"}
        assert stepped and recorded == stepped


def test_a_detached_model_instrumented_again_under_a_third_job_is_measured_again(
    accumulated: tuple[JobRun, Path],
) -> None:
    _, out = accumulated
    for rank in (0, 1):
        assert result(out, rank)["reattached"]
        third = read_jsonl(out / f"third{rank}.jsonl")
        steps = [r for r in third if r["kind"] == "step"]
        assert [r["step"] for r in steps] == [0, 1, 2, 3]
        (layout,) = [r for r in third if r["kind"] == "layout"]
        # torch rebuilt this model's buckets long ago: the layout read is the rebuilt one.
        assert len(layout["buckets"]) > 1
        assert all(len(r["collective_seqs"]) == len(layout["buckets"]) for r in steps if r["synced"])


# -- a peer dies while this rank hangs -------------------------------------------------------------


def test_a_hang_that_ends_because_the_peer_died_is_not_reported_resolved(tmp_path: Path) -> None:
    env = {"DDPSCOPE_HANG_TIMEOUT": "1.0", "DDPSCOPE_HEARTBEAT_S": "0.2", "JOB_PEER_DIES_AFTER_S": "3.0"}
    job = run("peer_dies", tmp_path, env)
    assert job.results[1].returncode == 3, job.output()
    assert job.results[0].returncode not in (0, None), job.output()
    # At step 2, where the peer died; on a loaded machine an earlier step can outlast the 1 s timeout too (a
    # real hang, resolved, and not the one under test).
    (hang,) = [h for h in job.of(0, "hang") if h["step"] == 2]
    assert hang["phase"] == "allreduce"
    failed = [r for r in job.of(0, "collective_end") if not r["ok"]]
    assert failed and {r["coll_seq"] for r in failed} <= {c["coll_seq"] for c in hang["inflight"]}
    # Not resolved after it. (A hang_resolved says the step the rank was in when it moved on: an earlier
    # step's hang resolved as step 2 began says step 2 too, and is not this one.)
    assert [r for r in job.of(0, "hang_resolved") if r["time_ns"] > hang["time_ns"]] == []
    assert any("Connection" in r["message"] for r in job.of(0, "rank_error"))


# -- waiting for a slow peer outside the gradient all-reduces --------------------------------------


def test_waiting_for_a_slow_peer_in_torchs_buffer_broadcast_and_a_loss_all_reduce_is_recorded_by_phase(
    tmp_path: Path,
) -> None:
    job = run("waits", tmp_path)
    assert all(exited_cleanly(r) for r in job.results), job.output()

    def medians(rank: int) -> tuple[float, float]:
        steps = job.of(rank, "step")[1:]  # step 0 has no previous step to wait after
        assert len(steps) == 5
        return (
            statistics.median(s["blocked_forward_ns"] for s in steps) / 1e9,
            statistics.median(s["blocked_between_ns"] for s in steps) / 1e9,
        )

    # Rank 0 waits for rank 1's 50 ms in the broadcast torch runs before forward (C++, not a recorded
    # collective) and for its 30 ms in the loss all-reduce; rank 1, the slow one, hardly waits at all.
    forward, between = medians(0)
    assert 0.035 < forward < 0.2 and 0.02 < between < 0.2, (forward, between)
    slow_forward, slow_between = medians(1)
    assert slow_forward < 0.015 and slow_between < 0.015, (slow_forward, slow_between)


# -- uneven inputs under torch's Join --------------------------------------------------------------


def test_uneven_inputs_under_torchs_join_train_as_uninstrumented_and_raise_no_incident(
    tmp_path: Path,
) -> None:
    from ddpscope.server.analysis.incidents import diagnose
    from ddpscope.server.analysis.snapshot import snapshot_from_records

    job = run("join", tmp_path)
    assert all(exited_cleanly(r) for r in job.results), job.output()
    for rank in (0, 1):
        assert result(tmp_path, rank)["instrumented"] == result(tmp_path, rank)["plain"]
    records = {rank: read_jsonl(tmp_path / f"joined{rank}.jsonl") for rank in (0, 1)}
    steps = {rank: [r["step"] for r in records[rank] if r["kind"] == "step"] for rank in (0, 1)}
    # The shadowing rank records no step, then both train an even epoch.
    assert steps == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4, 5, 6, 7]}
    # Rank 0's step 4 is not rank 1's: its replica digests stopped when it began to shadow.
    digests = {rank: [r["step"] for r in records[rank] if r["kind"] == "replica_digest"] for rank in (0, 1)}
    assert digests == {0: [0, 1, 2], 1: [0, 1, 2, 4]}
    colls = {
        rank: {r["coll_seq"]: r for r in records[rank] if r["kind"] == "collective" and r["pg"] == "default"}
        for rank in (0, 1)
    }
    assert colls[0].keys() == colls[1].keys()
    shadows = [c for c in colls[0].values() if c["source"] == "join" and c["shapes"] != [[1]]]
    assert len(shadows) == 3 and all(c["step"] is None for c in shadows)  # rank 0 shadows 3 steps' buckets
    # torch's buffer broadcast before each of rank 1's 8 forwards (shadowed by rank 0 after its 3) and the
    # rebuild's 2 index broadcasts run in C++: recorded alike on both sides, from the rank still training.
    broadcasts = [seq for seq, c in colls[1].items() if c["op"] == "broadcast"]
    assert len(broadcasts) == 10, colls[1]
    assert all(colls[0][seq]["shapes"] == colls[1][seq]["shapes"] for seq in broadcasts)
    assert [colls[0][seq]["root"] for seq in broadcasts].count(1) == 8
    # The join handshake is the Join's on both sides, from different lines of the script.
    handshakes = [seq for seq, c in colls[1].items() if c["op"] == "all_reduce" and c["shapes"] == [[1]]]
    assert handshakes and all(colls[r][seq]["source"] == "join" for seq in handshakes for r in (0, 1))
    assert any(colls[0][seq]["call_site"] != colls[1][seq]["call_site"] for seq in handshakes)
    every = [r for rank in (0, 1) for r in records[rank]]
    incidents = diagnose(
        snapshot_from_records("edge-join", every), max(r["time_ns"] for r in every) / 1e9 + 1
    )
    assert incidents == [], [i.message for i in incidents]


# -- mixed dtypes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_dtypes(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobRun, Path]:
    out = tmp_path_factory.mktemp("dtypes")
    job = run("dtypes", out)
    assert all(exited_cleanly(r) for r in job.results), job.output()
    return job, out


def test_torchs_rebuild_puts_the_fp32_bucket_before_the_bf16_head_whose_gradients_arrive_first(
    mixed_dtypes: tuple[JobRun, Path],
) -> None:
    job, out = mixed_dtypes
    for rank in (0, 1):
        logged = result(out, rank)["logged"]
        # Parameter 4 and 5 are the head's: first in the ready order, in the last bucket after the rebuild.
        assert logged["prev_iteration_grad_ready_order_indices"].replace(" ", "").startswith("5,4,")
        assert logged["rebuilt_per_bucket_param_indices"].split(",")[-1].split() == ["5", "4"]
        assert [b["dtype"] for b in job.of(rank, "layout")[-1]["buckets"]] == ["float32", "bfloat16"]


def test_the_collector_judges_torchs_mixed_dtype_buckets_out_of_order_and_blames_torchs_dtype_order(
    mixed_dtypes: tuple[JobRun, Path],
) -> None:
    from ddpscope.server.analysis.buckets import bucket_stats
    from ddpscope.server.rows import step_rows_from_wire

    job, _ = mixed_dtypes
    records = job.records[0] + job.records[1]
    stats = bucket_stats([r for r in records if r["kind"] == "layout"], step_rows_from_wire(records))
    steps = 2 * 4  # steps 1-4 of 5 (under the layout torch rebuilt at step 1), on both ranks
    assert [(b.dtype, b.steps, b.out_of_order) for b in stats] == [
        ("float32", steps, 0),
        ("bfloat16", steps, steps),
    ]
    advice = stats[1].advice
    assert advice is not None and "holds bfloat16 and bucket 0 float32" in advice
    assert "not rebuilt again" in advice and "find_unused_parameters" not in advice
