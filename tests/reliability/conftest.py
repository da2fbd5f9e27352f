"""Reliability fixtures: real collectors, real agents in child processes, exact record accounting.

Every figure a test measures goes through the ``figures`` fixture into
``bench/results/reliability.json`` (merged with what other runs wrote, so running one test updates
only its own entries).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_env import agent_env  # noqa: F401 - the suite imports it from here
from tests.support.collector_proc import CollectorProc
from tests.support.procs import kill_group

HERE = Path(__file__).parent
RESULTS = HERE.parent.parent / "bench" / "results" / "reliability.json"
EMITTER = HERE / "emitter.py"
GLOO_JOB = HERE / "gloo_job.py"

_figures: dict[str, Any] = {}


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    """A dict each test fills with what it measured; written to bench/results/reliability.json."""
    yield _figures
    if not _figures:
        return
    try:
        merged = json.loads(RESULTS.read_text())
    except (FileNotFoundError, ValueError):
        merged = {}
    merged.update(_figures)
    merged["updated_unix"] = int(time.time())
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


class Started:
    """Child processes a test starts; every one is killed (by process group) at the end."""

    def __init__(self, spool_dirs: list[Path]) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.spool_dirs = spool_dirs

    def emitter(self, env: dict[str, str], n: int, rate: float, first: int = 0) -> subprocess.Popen[str]:
        return self.run([sys.executable, str(EMITTER), str(n), str(rate), str(first)], env)

    def run(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.procs.append(p)
        spool = env.get("DDPSCOPE_SPOOL_DIR")
        if spool:
            self.spool_dirs.append(Path(spool))
        return p


@pytest.fixture
def started() -> Iterator[Started]:
    spools: list[Path] = []
    s = Started(spools)
    yield s
    for p in s.procs:
        if p.poll() is None:
            kill_group(p)
        with contextlib.suppress(Exception):
            p.communicate(timeout=10)
    for d in spools:
        kill_shippers(d)


def finish(p: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """Wait for an emitter and return its JSON summary; fail with its stderr if it did not exit 0."""
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(p)
        out, err = p.communicate(timeout=10)
        raise AssertionError(f"emitter did not finish within {timeout_s} s: {err[-2000:]}") from None
    assert p.returncode == 0, f"emitter exited {p.returncode}: {err[-3000:]}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def kill_shippers(spool_dir: Path) -> None:
    """SIGKILL the shippers serving ``spool_dir`` (each writes its pid into its lock file)."""
    for lock in spool_dir.rglob("*.lock"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(lock.read_text())
            if pid > 0:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProc]:
    """A collector on a fresh SQLite file (not started: the test decides when)."""
    c = CollectorProc(f"sqlite:///{tmp_path / 'collector.db'}", log_path=tmp_path / "collector.log")
    yield c
    c.kill()


# -- accounting ---------------------------------------------------------------------------------


@dataclass
class Accounting:
    """Step records of one job as the collector's database holds them."""

    rows: int = 0
    """Rows in ``steps`` (the unique key makes each an idempotency key)."""
    distinct_steps: int = 0
    """Distinct (rank, step): a record stored twice under two keys would show as rows > this."""
    per_rank: dict[int, set[int]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    """Sum over every stream's latest ``agent_stats`` of its drop counters, by 'reason:kind'."""
    emitted: int = 0

    @property
    def duplicates(self) -> int:
        return self.rows - self.distinct_steps

    @property
    def dropped_steps(self) -> int:
        return sum(n for k, n in self.dropped.items() if k.endswith(":step"))


def account(db_path: Path, job: str) -> Accounting:
    acc = Accounting()
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        row = con.execute("SELECT id FROM jobs WHERE job = ?", (job,)).fetchone()
        if row is None:
            return acc
        job_id = row[0]
        acc.rows = con.execute("SELECT count(*) FROM steps WHERE job_id = ?", (job_id,)).fetchone()[0]
        for rank, step in con.execute("SELECT DISTINCT rank, step FROM steps WHERE job_id = ?", (job_id,)):
            acc.per_rank.setdefault(rank, set()).add(step)
        acc.distinct_steps = sum(len(s) for s in acc.per_rank.values())
        for (body,) in con.execute("SELECT body FROM agent_stats WHERE job_id = ?", (job_id,)):
            stats = json.loads(body)
            acc.dropped.update(stats.get("dropped", {}))
            acc.emitted += int(stats.get("emitted", 0))
    finally:
        con.close()
    return acc


def wait_for(db_path: Path, job: str, expected_rows: int, timeout_s: float) -> Accounting:
    """Poll the database until ``expected_rows`` step rows of ``job`` arrived or the deadline passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        acc = account(db_path, job) if db_path.exists() else Accounting()
        if acc.rows >= expected_rows or time.monotonic() > deadline:
            return acc
        time.sleep(0.2)


def integrity_ok(db_path: Path) -> str:
    con = sqlite3.connect(str(db_path), timeout=10)
    try:
        return str(con.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        con.close()
