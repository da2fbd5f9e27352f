"""Real 2-rank gloo jobs whose rank 1 spends 2 s writing a log every sixth step (``jobs/stall.py``), under
ddpscope's engine and under torch's DDP with ``instrument()``: rank 1's watchdog samples its main thread in
those stalls, and the collector's ``/stalls`` names the line of the slow write, blocked, with its stack.

Every rank and the collector are killed by process group when the module's jobs are done."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.real_job import RealJob, get_json, jobs_at_one_collector

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "jobs" / "stall.py"
JOBS = (("stall", "ddpscope"), ("stall", "torch"))
WAIT_S = 120.0
SLOW_LINE = next(
    n
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1)
    if "the line the collector should name" in line
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    tmp = tmp_path_factory.mktemp("stall")
    with jobs_at_one_collector(
        tmp, SCRIPT, JOBS, prefix="stall", hang_timeout_s=60, wait_s=WAIT_S
    ) as started:
        yield started


@pytest.mark.parametrize("engine", ["ddpscope", "torch"])
def test_a_rank_that_stalls_now_and_then_is_named_with_the_line_it_spent_the_stalls_on(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs["stall", engine]
    assert j.exited_cleanly(), j.logs()
    assert j.settled_status() == "finished"
    (stall,) = get_json(f"{j.url}/api/v1/jobs/{j.job}/stalls")["items"]
    assert (stall["rank"], stall["every"], stall["phase"]) == (1, 6, "between_steps"), stall
    sampled = stall["sampled"]
    assert sampled is not None, stall
    assert sampled["site"].endswith(f"stall.py:{SLOW_LINE}") and sampled["blocked"] is True, sampled
    # A sample taken as a stall ends may find the thread past the write (ticks are 0.25 s apart).
    assert sampled["samples"] >= 2 and sampled["samples"] * 2 > sampled["of"] and sampled["stalls"] >= 1, (
        sampled
    )
    assert "in write_log" in sampled["stack"] and "time.sleep(2.0)" in sampled["stack"], sampled
    assert f"its main thread was at {sampled['site']} in " in stall["message"], stall["message"]
