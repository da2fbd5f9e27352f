"""Real 2-rank gloo jobs whose rank 1 keeps 2 MiB every step (``jobs/leak.py``), under ddpscope's engine
and under torch's DDP with ``instrument()``, one whose rank 1's DataLoader worker keeps 2 MiB a batch, and
one that keeps nothing: the ranks' watchdogs send their memory and their workers', and the collector names
rank 1's growth (or its worker's) with its pace per step, and nothing for the ranks that keep nothing.

Every rank and the collector are killed by process group when the module's jobs are done."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real_job import RealJob, get_json, jobs_at_one_collector

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "jobs" / "leak.py"
JOBS = (("leak", "ddpscope"), ("leak", "torch"), ("workers", "ddpscope"))
"""Three jobs at once on two cores (a fourth made the leak's pace too uneven to judge, 1 run in 4): the
workers job's rank 0, and its rank 1's own process, keep nothing and are the steady case."""
WAIT_S = 150.0


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    tmp = tmp_path_factory.mktemp("memory")
    with jobs_at_one_collector(tmp, SCRIPT, JOBS, prefix="mem", hang_timeout_s=300, wait_s=WAIT_S) as started:
        yield started


def growth(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "memory_growth"]


def growth_found(j: RealJob, what: str) -> list[dict[str, Any]]:
    """The job's ``memory_growth`` incidents once there are any; if none come, the failure shows each rank's
    samples (time, step, MiB resident, MiB in its workers): a leak's pace is what such a failure is about."""
    try:
        return j.wait_for(what, growth)
    except AssertionError as e:
        ranks = get_json(f"{j.url}/api/v1/jobs/{j.job}/memory")["items"]
        samples = {
            r["rank"]: [(round(s[0], 2), s[1], s[2] >> 20, s[4] >> 20) for s in r["samples"]] for r in ranks
        }
        raise AssertionError(f"{e}\nsamples: {samples}") from None


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_a_rank_that_keeps_memory_every_step_is_named_with_its_pace_per_step(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs["leak", engine]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    (inc,) = growth_found(j, "rank 1's memory growth")
    assert inc["rank"] == 1 and inc["culprit_ranks"] == [1], inc
    assert inc["message"].startswith(
        "Rank 1's memory (its heap and tensors: not the libraries and files it maps) grew steadily from "
    ), inc
    ranks = get_json(f"{j.url}/api/v1/jobs/{j.job}/memory")["items"]
    assert [r["growing"] for r in ranks] == [False, True], ranks
    per_step = inc["message"].split("/min, ")[1].split(" a step")[0]
    assert per_step.endswith("MiB") and 1.8 <= float(per_step.split()[0]) <= 2.3, inc["message"]


def test_a_dataloader_worker_that_keeps_memory_every_batch_is_named_as_its_ranks_workers_not_the_ranks(
    jobs: dict[tuple[str, str], RealJob],
) -> None:
    j = jobs["workers", "ddpscope"]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    (inc,) = growth_found(j, "rank 1's workers' memory growth")
    assert inc["rank"] == 1 and inc["culprit_ranks"] == [1], inc
    assert inc["message"].startswith(
        "Rank 1's DataLoader workers' own memory (not shared with the rank; 1 of them) grew steadily from "
    ), inc
    ranks = get_json(f"{j.url}/api/v1/jobs/{j.job}/memory")["items"]
    # Rank 0 keeps nothing, nor does rank 1's own process: the steady case.
    assert [r["rank"] for r in ranks] == [0, 1] and [r["growing_in"] for r in ranks] == [None, "workers"], (
        ranks
    )
    assert all(len(r["samples"]) >= 8 and 0 < r["rss_bytes"] < r["total_bytes"] for r in ranks), ranks
    # Rank 0 has no workers; rank 1's one is in its samples (gone from the latest once the loop ended).
    assert [max(s[4] for s in r["samples"]) > 0 for r in ranks] == [False, True], ranks
    per_step = inc["message"].split("/min, ")[1].split(" a step")[0]
    assert per_step.endswith("MiB") and 1.7 <= float(per_step.split()[0]) <= 2.3, inc["message"]
