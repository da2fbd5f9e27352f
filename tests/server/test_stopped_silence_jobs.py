"""A rank silent when the job was stopped keeps its diagnosis: real 2-rank gloo jobs at a real collector.

Rank 1 enters a regular expression that backtracks for minutes while holding the GIL (``re`` checks for
signals, so a SIGTERM still runs its handler): no thread of it runs, heartbeats included, and the
collector calls it ``rank_silent``. Rank 0 waits for it in the next all-reduce, beating all along. Then
the scheduler cancels the job (SIGTERM to every rank). The job used to read as a cancellation with only
rank 0's wait left; now it is ``failed`` and rank 1's silence is kept, until its stop. A healthy job stopped
the same way, while it trains or while its ranks work outside collectives for longer than a rank may stay
silent (heartbeats only, as in a checkpoint write), still reads as a cancellation: ``finished``.

This file is also the rank script (``python test_stopped_silence_jobs.py SCENARIO ENGINE``; torch is
imported only there). Every job has a deadline and every rank is killed by its process group.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAULT_STEP = 3
STEPS = 6
TRAINING_STEPS = 100_000
"""The ``training`` scenario trains until it is stopped."""
IDLE_S = 13.0
"""How long the ``idle`` scenario's ranks have been out of collectives (their heartbeats go on) when the test
stops them: over the collector's 10 s silent threshold."""
BACKTRACKING = "a" * 36 + "b"
"""``(a+)+$`` against this backtracks 2**36 ways: 2.3 s at 26 characters here, each one more doubles it,
so about 40 minutes (on a free core): far longer than the test, which stops it."""
QUIET_S = 16
"""How long the collector has seen rank 1 silent when the test stops the job."""
HANG_TIMEOUT_S = 300.0
"""ddpscope's default: no rank reports a hang in these jobs."""


# ------------------------------------------------------------------------------------- the rank script


def rank_main(scenario: str, engine: str) -> None:  # pragma: no cover - runs in the ranks
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.ddp import DistributedDataParallel, instrument, monitor

    monitor.enable()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rank = dist.get_rank()
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model: nn.Module = (
        instrument(nn.parallel.DistributedDataParallel(net))
        if engine == "torch"
        else DistributedDataParallel(net)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(TRAINING_STEPS if scenario == "training" else STEPS):
        if step == FAULT_STEP and rank == 1 and scenario == "gil":
            re.match(r"(a+)+$", BACKTRACKING)  # holds the GIL for minutes
        if step == FAULT_STEP and scenario == "idle":
            time.sleep(600)  # a checkpoint write: the GIL is free, heartbeats go on
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        if scenario == "training":
            time.sleep(0.05)  # leave the 2 cores to the other jobs
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    rank_main(sys.argv[1], sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

from tests.support.real_job import RealJob, get_json, jobs_at_one_collector  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__)
ENGINES = ("ddpscope", "torch")
JOBS = (*(("gil", engine) for engine in ENGINES), ("training", "ddpscope"), ("idle", "ddpscope"))
WAIT_S = 180.0
"""Deadline for one diagnosis: 8 ranks import torch at once on 2 cores first, then two of them spin."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RealJob]]:
    """Both jobs started at once against one real collector (their silences overlap); killed at the end."""
    with jobs_at_one_collector(
        tmp_path_factory.mktemp("stopped-silence"),
        SCRIPT,
        JOBS,
        prefix="silence",
        hang_timeout_s=HANG_TIMEOUT_S,
        wait_s=WAIT_S,
    ) as started:
        yield started


def silent(incidents: list[dict[str, Any]], rank: int = 1) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "rank_silent" and i["rank"] == rank]


def steps_done(j: RealJob) -> int:
    jobs = get_json(f"{j.url}/api/v1/jobs")["items"]
    return int(next((x.get("steps") or 0 for x in jobs if x["job"] == j.job), 0))


def stop_and_wait_for_the_end(j: RealJob) -> str | None:
    """SIGTERM every rank (by pid, as scancel or a time limit does); the job's status once it ended."""
    for p in j.procs:
        p.send_signal(signal.SIGTERM)
    assert j.wait_exit() == [-signal.SIGTERM, -signal.SIGTERM], j.logs()
    deadline = time.monotonic() + WAIT_S
    while j.status() not in ("finished", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
    return j.status()


def quiet_s(incident: dict[str, Any]) -> int:
    """The N of a rank_silent's "sent nothing for N s"."""
    found = re.search(r"sent nothing for (\d+) s", incident["message"])
    assert found is not None, incident
    return int(found.group(1))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rank_holding_the_gil_when_the_job_was_stopped_fails_it_and_stays_the_culprit(
    jobs: dict[tuple[str, str], RealJob], engine: str
) -> None:
    j = jobs[("gil", engine)]
    # While it lasts: rank 1 sends nothing (its heartbeat thread cannot take the GIL), rank 0 does. The
    # collector calls it silent after 10 s; the stop comes once the collector has seen QUIET_S of it, so
    # that records of its last moments still on their way cannot bring the silence under 10 s.
    (during,) = j.wait_for(
        f"rank 1's silence for {QUIET_S:.0f} s", lambda inc: [i for i in silent(inc) if quiet_s(i) >= QUIET_S]
    )
    assert during["culprit_ranks"] == [1], during
    assert j.status() == "hung"
    # re checks for signals while it backtracks: the agent's handler runs, reports the stop, and the rank
    # ends as SIGTERM ends it. Rank 0, blocked in gloo, is stopped by the SIGTERM watcher.
    assert stop_and_wait_for_the_end(j) == "failed", j.logs()
    (after,) = j.wait_for(
        "rank 1's silence until its stop",
        lambda inc: [i for i in silent(inc) if "until it was stopped by SIGTERM" in i["message"]],
    )
    assert after["culprit_ranks"] == [1] and after["step"] == FAULT_STEP - 1, after
    assert quiet_s(after) >= 10, after  # the collector's silent threshold: the rule's own condition
    assert "held the GIL" in after["message"] and "py-spy dump --native" in after["message"], after
    incidents = j.incidents()
    # Rank 0 waited in the next all-reduce for rank 1, beating all along: never called silent, and its
    # wait names rank 1.
    assert silent(incidents, rank=0) == [], incidents
    waits = [i for i in incidents if i["kind"] == "missing_collective"]
    assert [w["culprit_ranks"] for w in waits] == [[1]], incidents
    assert "until it was stopped by SIGTERM; rank 1 never issued it" in waits[0]["message"], waits


@pytest.mark.parametrize("scenario", ["training", "idle"])
def test_a_healthy_job_stopped_while_it_trained_or_worked_outside_collectives_is_finished(
    jobs: dict[tuple[str, str], RealJob], scenario: str
) -> None:
    j = jobs[(scenario, "ddpscope")]
    deadline = time.monotonic() + WAIT_S
    want = 20 if scenario == "training" else FAULT_STEP
    while steps_done(j) < want and time.monotonic() < deadline:
        time.sleep(0.5)
    assert steps_done(j) >= want, j.logs()
    if scenario == "idle":
        time.sleep(IDLE_S)  # no step, no collective since: heartbeats only
    assert stop_and_wait_for_the_end(j) == "finished", j.incidents()
    assert j.incidents() == []
