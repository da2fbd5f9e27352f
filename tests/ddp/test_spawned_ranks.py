"""Ranks with no RANK in their environment (torch.multiprocessing.spawn, a rank passed to
init_process_group) label their records with the process group's rank, not all with rank 0."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from ddpscope import agent
from tests.support.procs import free_port, kill_group

JOB = Path(__file__).parent / "jobs" / "spawned.py"


def test_ranks_started_by_multiprocessing_spawn_report_under_their_own_ranks(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        OMP_NUM_THREADS="1",
        DDPSCOPE_JOB="spawned",
        DDPSCOPE_SPOOL_DIR=str(tmp_path / "spool"),
        DDPSCOPE_URL="http://127.0.0.1:9",  # nothing listens: the shipper keeps the records spooled
        PYTHONPATH=str(Path(__file__).parents[2]),
    )
    proc = subprocess.Popen(
        [sys.executable, str(JOB), str(free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    assert "rank 0: agent 0, watchdog 0" in out and "rank 1: agent 1, watchdog 1" in out, out
    assert "rank 0: reconfigured 0" in out and "rank 1: reconfigured 1" in out, out


@pytest.fixture
def fresh_agent() -> Iterator[None]:
    yield
    agent.configure(exporter=agent.InMemoryExporter())


def test_an_agent_given_a_rank_or_an_exporter_of_the_callers_keeps_them(
    fresh_agent: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    exporter = agent.InMemoryExporter()
    mine = agent.configure(exporter=exporter)  # no rank, the caller's exporter: left as it is
    agent.adopt_rank(3)
    assert agent.get_agent() is mine and mine.config.rank is None
    ranked = agent.configure(rank=5, spool_dir=str(tmp_path))
    agent.adopt_rank(3)
    assert agent.get_agent() is ranked and ranked.config.rank == 5


def test_an_agent_made_from_an_environment_without_rank_takes_the_groups(
    fresh_agent: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process: a new agent takes its rank")
    before = agent.configure(spool_dir=str(tmp_path), job="spawned-unit")
    assert before.config.rank is None
    agent.adopt_rank(2)
    after = agent.get_agent()
    assert after is not before and after.config.rank == 2 and after.config.job == "spawned-unit"
