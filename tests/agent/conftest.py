"""Agent test fixtures: swallowed errors fail the test, every agent and shipper started is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpscope.agent import _core, _errors, spool
from tests.agent.fake_collector import FakeCollector
from tests.support.procs import kill_group, pid_alive


@pytest.fixture(autouse=True)
def agent_errors_fail_the_test() -> Iterator[list[BaseException]]:
    """The agent swallows errors so training survives; a test must not. Tests that provoke an error
    on purpose take this fixture and clear the list."""
    seen: list[BaseException] = []

    def hook(where: str, exc: BaseException) -> None:
        seen.append(exc)

    _errors.HOOKS.append(hook)
    try:
        yield seen
    finally:
        _errors.HOOKS.remove(hook)
    if seen:
        raise seen[0]


@pytest.fixture(autouse=True)
def fresh_agent() -> Iterator[None]:
    yield
    agent = _core._agent
    _core._agent = None
    if agent is not None:
        agent.shutdown(2.0)


def shipper_pids(spool_dir: Path) -> list[int]:
    """Pids of shippers serving streams in ``spool_dir`` (they write their pid into the lock file)."""
    pids = []
    # A shipper that delivered everything removes its spool directory, possibly while this walks it.
    with contextlib.suppress(FileNotFoundError):
        for lock in spool_dir.rglob("*.lock"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(lock.read_text()))
    return pids


def kill_shippers(spool_dir: Path) -> None:
    for pid in shipper_pids(spool_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait_shippers_gone(spool_dir: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(pid_alive(pid) for pid in shipper_pids(spool_dir)):
            return True
        time.sleep(0.05)
    return False


def spool_agent(spool_dir: Path, job: str, rank: int = 0) -> Any:
    """An agent spooling into ``spool_dir`` whose exporter and write-ahead ring exist. Port 9 refuses
    connections: the spool keeps what was written for the test to read."""
    from ddpscope import agent

    a = agent.configure(
        job=job, rank=rank, url="http://127.0.0.1:9", spool_dir=str(spool_dir), flush_interval_s=60
    )
    assert a.flush_local(30.0)
    return a


def spooled(spool_dir: Path) -> list[dict[str, Any]]:
    """Every record in the spool's segments (the collector is unreachable, so nothing is deleted)."""
    out: list[dict[str, Any]] = []
    for path in sorted(spool_dir.glob("*.seg")):
        for payload, _ in spool.parse(path.read_bytes(), final=False).entries:
            out += spool.decode_batch(payload)
    return out


@pytest.fixture
def spool_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "spool"
    d.mkdir()
    yield d
    _core.shutdown(2.0)  # before the kill: a shutdown drain could otherwise restart a shipper
    kill_shippers(d)


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    with FakeCollector(hang_s=10.0) as c:
        yield c


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test starts (each in its own process group): whatever still runs at the end is
    killed by its group, and every one is reaped."""
    procs: list[subprocess.Popen[Any]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            kill_group(p)
        p.communicate(timeout=10)
