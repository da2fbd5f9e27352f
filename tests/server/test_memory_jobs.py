"""Real 2-rank gloo jobs whose rank 1 keeps 2 MiB every step (``jobs/leak.py``), under ddpscope's engine
and under torch's DDP with ``instrument()``, and one that keeps nothing: the ranks' watchdogs send their
memory, and the collector names rank 1's growth with its pace per step, and nothing for the steady job.

Every rank and the collector are killed by process group when the module's jobs are done."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real_job import RealJob, get_json, jobs_at_one_collector

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "jobs" / "leak.py"
JOBS = (("leak", "ddpscope"), ("leak", "torch"), ("steady", "ddpscope"))
WAIT_S = 150.0


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    tmp = tmp_path_factory.mktemp("memory")
    with jobs_at_one_collector(tmp, SCRIPT, JOBS, prefix="mem", hang_timeout_s=300, wait_s=WAIT_S) as started:
        yield started


def growth(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "memory_growth"]


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_a_rank_that_keeps_memory_every_step_is_named_with_its_pace_per_step(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs["leak", engine]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    (inc,) = j.wait_for("rank 1's memory growth", growth)
    assert inc["rank"] == 1 and inc["culprit_ranks"] == [1], inc
    assert inc["message"].startswith("Rank 1's memory grew steadily from "), inc
    ranks = get_json(f"{j.url}/api/v1/jobs/{j.job}/memory")["items"]
    assert [r["growing"] for r in ranks] == [False, True], ranks
    per_step = inc["message"].split("/min, ")[1].split(" a step")[0]
    assert per_step.endswith("MiB") and 1.8 <= float(per_step.split()[0]) <= 2.3, inc["message"]


def test_a_job_that_keeps_nothing_gets_no_memory_incident(jobs: dict[tuple[str, str], RealJob]) -> None:
    j = jobs["steady", "ddpscope"]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    assert growth(j.incidents()) == [], j.incidents()
    ranks = get_json(f"{j.url}/api/v1/jobs/{j.job}/memory")["items"]
    assert [r["rank"] for r in ranks] == [0, 1] and not any(r["growing"] for r in ranks), ranks
    assert all(len(r["samples"]) >= 8 and 0 < r["rss_bytes"] < r["total_bytes"] for r in ranks), ranks
