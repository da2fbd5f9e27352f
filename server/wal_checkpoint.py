"""SQLite WAL checkpoints on a thread of their own, so that commits do not pay for them.

By default the commit that takes SQLite's write-ahead log past 1,000 pages also copies the whole log
into the database file and syncs it before it returns: for step rows, about half the time of a plain
``executemany`` insert (``bench/collector.py`` measures it). SQLite's documentation suggests the way out used
here: the writer's automatic checkpoint is raised to ``WRITER_CHECKPOINT_PAGES`` and a second connection
runs a PASSIVE checkpoint after commits, on another core (``sqlite3`` releases the GIL while SQLite works).
PASSIVE never waits for the writer or for readers, so it cannot stall ingest or the dashboard. The writer's
own checkpoint stays as the bound on the log's size: it runs only when this thread falls behind, and then
costs little, because most of the log has already been copied.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

logger = logging.getLogger(__name__)

WRITER_CHECKPOINT_PAGES = 4096
"""The writer's ``wal_autocheckpoint`` (16 MB of 4 kB pages): reached only when the thread falls behind."""
LOG_SIZE_LIMIT_BYTES = 64 << 20
"""``journal_size_limit``: the log file is truncated to this after a checkpoint has emptied it."""


class WalCheckpointer:
    """``written()`` after each commit wakes the thread (started then, so read-only users never start it);
    ``close()`` stops it. Failures are logged, never raised: the writer's checkpoint still bounds the log."""

    def __init__(self, path: str, *, busy_timeout_s: float) -> None:
        self._path = path
        self._busy_timeout_s = busy_timeout_s
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.checkpoints = 0
        """Checkpoints run so far (tests read it)."""

    def written(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(
                        target=self._run, name="ddpscope-wal-checkpoint", daemon=True
                    )
                    self._thread.start()
        self._wake.set()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self._path, isolation_level=None, timeout=self._busy_timeout_s)
        except sqlite3.Error as e:
            logger.warning("WAL checkpoints stay with the writer: cannot open %s (%s)", self._path, e)
            return
        failed = False
        try:
            while True:
                self._wake.wait()
                self._wake.clear()  # before the checkpoint: a commit during it wakes the next one
                try:
                    # fetchall, not fetchone: an unfinished statement would hold a read lock, and a
                    # log that some reader still uses is never started over.
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
                except sqlite3.Error as e:
                    if not failed:  # once: the writer's own checkpoint keeps the log bounded meanwhile
                        logger.warning(
                            "background WAL checkpoint failed (%s); the writer checkpoints itself", e
                        )
                    failed = True
                if self._closed:  # after one last checkpoint: the database file holds every commit
                    return
        finally:
            conn.close()
