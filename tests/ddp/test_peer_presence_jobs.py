"""Ranks of one job that run without ddpscope (``DDPSCOPE_DISABLED=1`` on one node only): real 2-rank gloo
jobs. Both used to hang in ddpscope's start-up clock ping-pong until the process group's timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import run_ranks

JOB = Path(__file__).parent / "jobs" / "half_disabled.py"
pytestmark = pytest.mark.slow


def run(engine: str, out: Path) -> list[dict[str, object]]:
    results = run_ranks(JOB, 2, args=[engine, str(out)], env={"DDPSCOPE_HANG_TIMEOUT": "3"}, timeout_s=90)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ddpscopes_engine_refuses_a_peer_without_ddpscope_naming_it_instead_of_hanging(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run("engine", tmp_path)
    assert rank0["raised"].startswith("RuntimeError: DistributedDataParallel: ranks [1] run without ddpscope")
    assert "Set DDPSCOPE_DISABLED alike on every rank" in rank0["raised"]
    assert rank1["raised"]  # torch's DDP there lost its peer: the job ends at once, not at the timeout


def test_instrument_trains_on_beside_a_peer_without_ddpscope(tmp_path: Path) -> None:
    rank0, rank1 = run("torch", tmp_path)
    assert rank0 == rank1 == {"raised": "", "equal": True}
