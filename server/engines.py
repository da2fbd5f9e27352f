"""SQLAlchemy engines for the two supported databases, configured for a write-heavy collector.

SQLite: WAL (readers never block the writer), ``synchronous=NORMAL`` (durable across a collector crash;
a power cut may lose the last transactions, which the agents' spool replays anyway), a busy timeout,
and exactly one writer connection whose transactions start with ``BEGIN IMMEDIATE`` so two writers
never deadlock upgrading a read lock. Readers use a small separate pool.

PostgreSQL (``postgresql+psycopg://``): one pool for both; concurrency is the server's business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from ddpscope.server.wal_checkpoint import LOG_SIZE_LIMIT_BYTES, WRITER_CHECKPOINT_PAGES, WalCheckpointer

BUSY_TIMEOUT_MS = 10_000


@dataclass(slots=True)
class Engines:
    writer: Engine
    reader: Engine
    dialect: str
    checkpointer: WalCheckpointer | None = None
    """SQLite only: checkpoints the write-ahead log off the writer's commits."""
    database_path: str | None = None
    """SQLite only: the database file, watched by ``file_problem``."""
    _identity: tuple[int, int] | None = None

    def file_problem(self) -> str | None:
        """SQLite only: why the database file is no longer the one the collector opened (deleted, or
        replaced), else None. SQLite keeps writing into a deleted file through its open handles, so
        every batch acknowledged after that would be lost with the process; one ``stat`` (~2 us)."""
        path = self.database_path
        if path is None:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if self._identity is None:
                return None  # not created yet (the migrations create it)
            return (
                f"the database file {path} was deleted while the collector ran; restart the collector "
                "(the agents keep what it refuses until then)"
            )
        if self._identity is None:
            self._identity = (st.st_dev, st.st_ino)
        elif (st.st_dev, st.st_ino) != self._identity:
            return f"the database file {path} was replaced while the collector ran; restart the collector"
        return None

    def committed(self) -> None:
        """Call after a write transaction commits."""
        if self.checkpointer is not None:
            self.checkpointer.written()

    def dispose(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.writer.dispose()
        if self.reader is not self.writer:
            self.reader.dispose()


def _sqlite_engine(url: str, *, pool_size: int, begin: str, pragmas: tuple[str, ...] = ()) -> Engine:
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=0,
        pool_timeout=30,
        connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Driver-level autocommit: pysqlite's own implicit BEGIN would defeat BEGIN IMMEDIATE.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        # Step rows are ~2 kB each: a 64 MB page cache keeps recent steps (what views read) in memory.
        cur.execute("PRAGMA cache_size=-65536")
        for pragma in pragmas:
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    return engine


def make_engines(url: str, *, pool_size: int = 8) -> Engines:
    """Engines for ``url`` (``sqlite:///path`` or ``postgresql+psycopg://...``)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise ValueError("--db: an in-memory SQLite database cannot be shared; give a file path")
        writer = _sqlite_engine(
            url,
            pool_size=1,
            begin="BEGIN IMMEDIATE",
            pragmas=(
                f"wal_autocheckpoint={WRITER_CHECKPOINT_PAGES}",
                f"journal_size_limit={LOG_SIZE_LIMIT_BYTES}",
            ),
        )
        reader = _sqlite_engine(url, pool_size=pool_size, begin="BEGIN")
        checkpointer = WalCheckpointer(parsed.database, busy_timeout_s=BUSY_TIMEOUT_MS / 1000)
        return Engines(writer, reader, "sqlite", checkpointer, database_path=os.path.abspath(parsed.database))
    if parsed.get_backend_name() == "postgresql":
        engine = create_engine(url, pool_size=pool_size, max_overflow=4, pool_pre_ping=True)
        return Engines(engine, engine, "postgresql")
    raise ValueError(
        f"--db: unsupported database {parsed.get_backend_name()!r}; use sqlite:/// or postgresql+psycopg://"
    )
