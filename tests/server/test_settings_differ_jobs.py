"""Real 2-rank gloo jobs whose rank 1 runs with another ``DDPSCOPE_HANG_TIMEOUT`` than rank 0, under
ddpscope's engine and under torch's DDP with ``instrument()``: both engines put the timeout in their
``rank_start``, and the collector reports one ``settings_differ`` incident naming it and rank 1.

The ranks run ``jobs/train.py`` to the end; every rank and the collector are killed by process group
when the module's jobs are done."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.collector_proc import CollectorProc
from tests.support.procs import started_ranks
from tests.support.real_job import RealJob, get_json

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "jobs" / "train.py"
STEPS = 6
ENGINES = ("ddpscope", "torch")
HANG_TIMEOUT_S = {0: "300", 1: "120"}
"""Per rank; both far above anything these jobs wait, so no rank reports a hang."""
WAIT_S = 150.0
"""Deadline for the diagnosis: 4 ranks import torch at once on 2 cores first."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RealJob]]:
    """One job per engine, started at once against one real collector; killed at the end."""
    tmp = tmp_path_factory.mktemp("settings-differ")
    with contextlib.ExitStack() as stack:
        collector = stack.enter_context(
            CollectorProc(f"sqlite:///{tmp / 'ddpscope.db'}", log_path=tmp / "collector.log")
        )
        url = collector.start()
        started: dict[str, RealJob] = {}
        for engine in ENGINES:
            job_id = f"settings-{engine}-{uuid.uuid4().hex[:6]}"
            env = {
                "DDPSCOPE_URL": url,
                "DDPSCOPE_JOB": job_id,
                "DDPSCOPE_HEARTBEAT_S": "0.5",
                "DDPSCOPE_SPOOL_DIR": str(tmp / job_id),
                "TRAIN_ENGINE": engine,
            }
            per_rank = {rank: {"DDPSCOPE_HANG_TIMEOUT": t} for rank, t in HANG_TIMEOUT_S.items()}
            procs = stack.enter_context(
                started_ranks(SCRIPT, 2, args=[str(STEPS)], env=env, per_rank_env=per_rank)
            )
            started[engine] = RealJob(url, job_id, procs, wait_s=WAIT_S, engine=engine)
        yield started


def settings_differ(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i["kind"] == "settings_differ"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rank_with_another_hang_timeout_is_named_in_one_settings_differ_incident(
    jobs: dict[str, RealJob], engine: str
) -> None:
    j = jobs[engine]
    assert j.exited_cleanly(), j.logs()
    (inc,) = j.wait_for("the ranks' different hang timeouts", settings_differ)
    # Two ranks: a tie, settled against rank 0, and the message says so.
    assert inc["culprit_ranks"] == [1], inc
    assert "hang_timeout_s is 300 on rank 0 but 120 on rank 1" in inc["message"], inc
    assert "(a tie: rank 1, which differs from rank 0, is named)" in inc["message"], inc
    assert "set DDPSCOPE_HANG_TIMEOUT the same on every rank" in inc["message"], inc
    # Nothing else differs between the ranks, and nothing else went wrong; the job's status is its own.
    assert "version" not in inc["message"] and "bucket_cap_mb" not in inc["message"], inc
    assert [i["kind"] for i in j.incidents()] == ["settings_differ"], j.incidents()
    deadline = time.monotonic() + WAIT_S
    while j.status() != "finished" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert j.status() == "finished"
    ranks = get_json(f"{j.url}/api/v1/jobs/{j.job}")["ranks"]
    assert {r["engine"] for r in ranks} == {engine}, ranks
