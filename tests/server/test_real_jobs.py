"""Real 4-rank gloo jobs with ddpscope's engine (and one with torch's DDP under ``instrument()``) stream
to a real collector process; the API must describe them: every step of every rank, one clock, and
stragglers only where there is one."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.server.live import live_collector
from tests.support.procs import describe, exited_cleanly, started_ranks, wait_all

pytest.importorskip("torch")

SCRIPT = Path(__file__).parent / "jobs" / "train.py"
STEPS = 24
WORLD = 4


def _wait_for_steps(url: str, job: str, expected: int, deadline_s: float) -> list[dict]:
    """Records reach the collector through the agent's spool and shipper, possibly after the ranks exit."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.get(f"{url}/api/v1/jobs/{job}/steps", timeout=30)
        items = r.json()["items"] if r.status_code == 200 else []
        if len(items) >= expected or time.monotonic() > end:
            return items
        time.sleep(0.5)


def _run_jobs(
    url: str, tmp_path: Path, jobs: dict[str, list[str]], engine: str = "ddpscope"
) -> dict[str, str]:
    """Run each named job (``train.py`` arguments after STEPS) as a 4-rank job to the end, one job after the
    other, under ``engine`` (see ``train.py``); wait until the collector holds every step of every rank.
    Returns name -> job id. One at a time: the step times are what is under test, and 12 ranks training at
    once on 2 cores are 6 ranks a core, an overload that can flag a rank that only lost the CPU."""
    ids = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in jobs}
    for name, extra in jobs.items():
        env = {
            "DDPSCOPE_URL": url,
            "DDPSCOPE_JOB": ids[name],
            "DDPSCOPE_SPOOL_DIR": str(tmp_path / name),
            "TRAIN_ENGINE": engine,
        }
        with started_ranks(SCRIPT, WORLD, args=[str(STEPS), *extra], env=env) as procs:
            results = wait_all(procs, timeout_s=240)
            assert all(exited_cleanly(r) for r in results), f"{name}:\n{describe(results)}"
    for name in jobs:
        items = _wait_for_steps(url, ids[name], WORLD * STEPS, deadline_s=60)
        assert {(i["rank"], i["step"]) for i in items} == {(r, s) for r in range(WORLD) for s in range(STEPS)}
    return ids


@pytest.mark.slow
def test_real_jobs_healthy_flags_nobody_and_a_slow_rank_is_flagged_alone(tmp_path):
    with live_collector(f"sqlite:///{tmp_path / 'c.db'}") as url:
        ids = _run_jobs(url, tmp_path, {"healthy": [], "slow": ["2"], "pairs": ["-1", "forward", "pairs"]})
        healthy = httpx.get(f"{url}/api/v1/jobs/{ids['healthy']}/stragglers", timeout=30).json()["items"]
        assert len(healthy) == WORLD and [s["rank"] for s in healthy if s["flagged"]] == [], healthy
        slow = httpx.get(f"{url}/api/v1/jobs/{ids['slow']}/stragglers", timeout=30).json()["items"]
        assert [s["rank"] for s in slow if s["flagged"]] == [2], slow
        assert next(s for s in slow if s["rank"] == 2)["phase"] == "forward"

        tl = httpx.get(f"{url}/api/v1/jobs/{ids['healthy']}/timeline?step={STEPS - 1}", timeout=30).json()
        assert [r["rank"] for r in tl["ranks"]] == list(range(WORLD))
        # One clock: every rank's step starts within a fraction of a step of the earliest one.
        assert max(r["forward"][0] for r in tl["ranks"]) < 0.5
        jobs_list = {j["job"]: j for j in httpx.get(f"{url}/api/v1/jobs", timeout=30).json()["items"]}
        assert jobs_list[ids["healthy"]]["status"] == "finished"
        # rank_start travels the spool like every record (it once carried torch.__version__, a str
        # subclass marshal refuses, and never arrived): the job says where each rank runs.
        detail = httpx.get(f"{url}/api/v1/jobs/{ids['healthy']}", timeout=30).json()
        assert [r["rank"] for r in detail["ranks"]] == list(range(WORLD)), detail
        assert all(r["pid"] and r["backend"] == "gloo" and r["torch_version"] for r in detail["ranks"])

        # DDP over two groups of two ranks: two models, each identical across its own group only.
        pairs = httpx.get(f"{url}/api/v1/jobs/{ids['pairs']}", timeout=30).json()
        assert (pairs["world_size"], pairs["status"]) == (WORLD, "finished"), pairs
        assert httpx.get(f"{url}/api/v1/jobs/{ids['pairs']}/incidents", timeout=30).json()["items"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("syncs", "engine"),
    [("", "ddpscope"), ("buffers,loss", "ddpscope"), ("buffers,loss", "torch")],
    ids=["plain", "batchnorm-and-loss-all-reduce", "batchnorm-and-loss-all-reduce-under-instrument"],
)
def test_a_real_rank_with_a_slow_data_loader_is_flagged_alone_between_steps(tmp_path, syncs, engine):
    # Rank 1 sleeps before each forward, outside the model: its compute is as fast as anyone's, and
    # the other ranks show the time as all-reduce wait. With BatchNorm they wait in the buffer
    # broadcast before forward instead, inside their own forward, and a loss all-reduce after each
    # step syncs them again: that waiting must not count as their own work. Under instrument() the
    # buffer broadcast is torch's own, in C++.
    with live_collector(f"sqlite:///{tmp_path / 'c.db'}") as url:
        args = ["1", "loader", syncs] if syncs else ["1", "loader"]
        ids = _run_jobs(url, tmp_path, {"loader": args}, engine)
        slow = httpx.get(f"{url}/api/v1/jobs/{ids['loader']}/stragglers", timeout=30).json()["items"]
        detail = httpx.get(f"{url}/api/v1/jobs/{ids['loader']}", timeout=30).json()
    assert {r["engine"] for r in detail["ranks"]} == {engine}, detail
    assert [s["rank"] for s in slow if s["flagged"]] == [1], slow
    assert next(s for s in slow if s["rank"] == 1)["phase"] == "between_steps"
