"""The hang watchdog in real 2-rank gloo jobs: reports while the main thread is blocked in gloo."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.ddp.failure_jobs.runner import JobRun, run_job, site
from tests.support.procs import exited_cleanly

pytestmark = pytest.mark.slow

HANG_ENV = {"DDPSCOPE_HANG_TIMEOUT": "1.0", "DDPSCOPE_HEARTBEAT_S": "0.2", "JOB_STALL_S": "3.5"}


@pytest.fixture(scope="module")
def stall(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """One job for the whole module: rank 1 sleeps 3.5 s before its all-reduce of step 1."""
    run = run_job("stall", tmp_path_factory.mktemp("stall"), env=HANG_ENV)
    assert all(exited_cleanly(r) for r in run.results), run.output()
    return run


def test_a_rank_blocked_in_gloo_reports_the_hang_with_phase_inflight_seq_call_site_and_stack(
    stall: JobRun,
) -> None:
    (hang,) = stall.of(0, "hang")
    assert (hang["phase"], hang["step"]) == ("allreduce", 1)
    assert hang["stalled_s"] >= 1.0
    (inflight,) = hang["inflight"]
    begun = [r for r in stall.of(0, "collective") if r["pg"] == "default"]
    assert inflight["coll_seq"] == begun[-2]["coll_seq"]  # the step-1 all-reduce, one before the last
    assert inflight["op"] == "all_reduce" and inflight["call_site"].endswith(site("step_all_reduce"))
    main = next(s for s in hang["stacks"] if s["thread"] == "MainThread")
    # The watchdog read the main thread's frames while it was blocked inside gloo's wait.
    assert "all_reduce" in main["stack"] and "work.wait()" in main["stack"]
    assert f"default#{inflight['coll_seq']} all_reduce" in hang["message"]


def test_the_waiting_rank_reports_hang_resolved_once_the_peer_resumes(stall: JobRun) -> None:
    (resolved,) = stall.of(0, "hang_resolved")
    (hang,) = stall.of(0, "hang")
    assert resolved["hang_s"] >= hang["stalled_s"] and resolved["time_ns"] > hang["time_ns"]


def test_the_sleeping_rank_is_reported_stuck_outside_any_collective(stall: JobRun) -> None:
    (hang,) = stall.of(1, "hang")
    assert hang["inflight"] == [] and "No collective is in flight" in hang["message"]
    main = next(s for s in hang["stacks"] if s["thread"] == "MainThread")
    assert "time.sleep" in main["stack"]
    assert "the main thread waits at" in hang["message"] and site("sleep") in hang["message"]
    last_seq = [r["coll_seq"] for r in stall.of(1, "collective") if r["pg"] == "default"][-3]
    assert f"its last collective was default#{last_seq} all_reduce" in hang["message"]
    # It resumed just before exiting: the watchdog's exit hook still reports the end of the hang.
    assert len(stall.of(1, "hang_resolved")) == 1


def test_heartbeats_arrive_at_the_configured_interval(stall: JobRun) -> None:
    for rank in (0, 1):
        beats = stall.of(rank, "heartbeat")
        assert len(beats) >= 10
        gaps = [(b["time_ns"] - a["time_ns"]) / 1e9 for a, b in zip(beats, beats[1:], strict=False)]
        # Generous bounds: other jobs share the two cores; the median is robust to a few late ticks.
        assert 0.1 <= statistics.median(gaps) <= 0.6
        assert beats[-1]["last_coll_seq"] >= beats[0]["last_coll_seq"]
        assert {b["pid"] for b in beats} and len({b["pid"] for b in beats}) == 1


def test_collectives_of_several_kinds_are_recorded_alike_on_both_ranks(stall: JobRun) -> None:
    def view(rank: int) -> list[tuple[object, ...]]:
        return [
            (r["pg"], r["coll_seq"], r["op"], r["reduce_op"], r["shapes"], r["dtypes"])
            for r in stall.of(rank, "collective")
            if r["pg"] == "default"
        ]

    assert view(0) == view(1)
    assert [v[2] for v in view(0)] == ["broadcast", "all_gather", "barrier"] + ["all_reduce"] * 3
    assert [v[4] for v in view(0)][:3] == [[[3, 4]], [[5]], []]
    assert [v[5] for v in view(0)][:2] == [["float32"], ["int64"]]
    sites = [r["call_site"] for r in stall.of(0, "collective") if r["pg"] == "default"][:3]
    assert [s.rsplit("/", 1)[-1] for s in sites] == [site("broadcast"), site("all_gather"), site("barrier")]
    # Point-to-point calls live on their own pair channel, numbered alike on both ends.
    (send,) = [r for r in stall.of(0, "collective") if r["op"] == "send"]
    (recv,) = [r for r in stall.of(1, "collective") if r["op"] == "recv"]
    assert send["pg"] == recv["pg"] == "default:p2p:0-1" and send["coll_seq"] == recv["coll_seq"] == 1
    # Their tag too (a receive takes only a message sent with its tag); 0, torch's default, is left out.
    assert send["tag"] == recv["tag"] == 3
    assert not any("tag" in r for r in stall.of(0, "collective") if r["pg"] == "default")
    for rank in (0, 1):
        ends = {(r["pg"], r["coll_seq"]) for r in stall.of(rank, "collective_end") if r["ok"]}
        assert ends == {(r["pg"], r["coll_seq"]) for r in stall.of(rank, "collective")}


def test_with_the_ddpscope_engine_a_straggling_peer_shows_as_a_hang_in_a_launched_bucket(
    tmp_path: Path,
) -> None:
    env = {"DDPSCOPE_HANG_TIMEOUT": "1.0", "DDPSCOPE_HEARTBEAT_S": "0.5", "JOB_STALL_S": "3.5"}
    run = run_job("engine", tmp_path, env=env)
    assert all(exited_cleanly(r) for r in run.results), run.output()
    assert all("internal_errors=0" in r.stdout for r in run.results)
    (hang,) = run.of(0, "hang")
    assert hang["step"] == 2 and hang["phase"] in ("backward", "allreduce")
    assert hang["pending_buckets"] and all(
        b["launched"] and not b["missing"] for b in hang["pending_buckets"]
    )
    assert f"bucket {hang['pending_buckets'][0]['index']}" in hang["message"]
    engine_seqs = {
        r["coll_seq"] for r in run.of(0, "collective") if r["source"] == "engine" and r["step"] == 2
    }
    assert {c["coll_seq"] for c in hang["inflight"]} <= engine_seqs
    assert len(run.of(0, "hang_resolved")) == 1

    def view(rank: int) -> list[tuple[object, ...]]:
        return [
            (r["coll_seq"], r["op"], r["source"], r["shapes"])
            for r in run.of(rank, "collective")
            if r["pg"] == "default"
        ]

    # The engine's collectives and the user's share one numbering, alike on both ranks, and the
    # engine's own torch.distributed calls are not recorded a second time as user calls.
    assert view(0) == view(1)
    user = [r for r in run.of(0, "collective") if r["source"] == "user"]
    assert len(user) == 4 and all(r["call_site"].endswith(site("engine_loss")) for r in user)
