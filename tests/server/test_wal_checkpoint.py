"""SQLite's write-ahead log is checkpointed by a thread of its own, and stays bounded without it."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from ddpscope.server import engines
from ddpscope.server.storage import Storage
from tests.server.conftest import decoded
from tests.support.synth import synth_job


def _steps_stored(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("SELECT count(*) FROM steps").fetchone()[0])


def _wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _write_jobs(storage: Storage, n: int, steps: int = 50, buckets: int = 50) -> None:
    for i in range(n):
        storage.write_batch(decoded(synth_job(4, steps, buckets, job=f"j{i}", collectives=False)))


def test_commits_leave_the_checkpoint_to_the_thread_which_copies_the_whole_log(tmp_path):
    path = tmp_path / "c.db"
    storage = Storage.open(f"sqlite:///{path}")
    try:
        with storage.engines.writer.connect() as conn:
            pages = conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar()
        assert pages == engines.WRITER_CHECKPOINT_PAGES
        checkpointer = storage.engines.checkpointer
        assert checkpointer is not None
        _write_jobs(storage, 3)
        assert _wait_until(lambda: checkpointer.checkpoints >= 1)
        time.sleep(0.2)  # the last commit's wake-up
        with sqlite3.connect(path) as conn:
            busy, log_frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()[0]
        assert (busy, copied) == (0, log_frames)
        assert _steps_stored(path) == 3 * 4 * 50
    finally:
        storage.close()
    assert not [t for t in threading.enumerate() if t.name == "ddpscope-wal-checkpoint"]


def test_a_reader_only_storage_starts_no_checkpoint_thread(tmp_path):
    storage = Storage.open(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        storage.jobs()
        assert not [t for t in threading.enumerate() if t.name == "ddpscope-wal-checkpoint"]
    finally:
        storage.close()


def test_without_the_thread_the_writers_own_checkpoint_still_bounds_the_log(tmp_path, monkeypatch):
    # A small bound so a few batches cross it; the thread is stopped before any write, as if it had
    # fallen behind or failed to open its connection.
    monkeypatch.setattr(engines, "WRITER_CHECKPOINT_PAGES", 64)
    path = tmp_path / "c.db"
    storage = Storage.open(f"sqlite:///{path}")
    try:
        assert storage.engines.checkpointer is not None
        storage.engines.checkpointer.close()
        _write_jobs(storage, 8)
        assert storage.engines.checkpointer.checkpoints == 0
        wal = os.path.getsize(f"{path}-wal")
        db = os.path.getsize(path)
        assert db > 4 * 64 * 4096, "the rows reached the database file: four times the bound"
        assert wal < db / 2, f"log of {wal} bytes next to a {db}-byte database: not checkpointed"
        assert _steps_stored(path) == 8 * 4 * 50
    finally:
        storage.close()


@pytest.mark.postgres
def test_postgresql_has_no_checkpoint_thread(pg_server):
    storage = Storage.open(pg_server.create_database("wal_checkpoint"))
    try:
        assert storage.engines.checkpointer is None
    finally:
        storage.close()
