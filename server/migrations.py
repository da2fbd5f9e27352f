"""Schema versioning: ordered migrations applied on start, under a lock, recorded in ``schema_version``.

Why not Alembic: the collector creates its own schema on start with no operator step, on SQLite and
PostgreSQL alike, and several collector processes may start at once against one PostgreSQL. A short
ordered list of functions, each run in the same transaction that bumps the version, under a database
lock (``pg_advisory_xact_lock`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), gives exactly that.

Rules for adding a migration: append ``(version, description, function)``; never edit one that has
shipped; a function receives the open connection and uses SQLAlchemy Core / DDL. Migration 1 creates
the tables as ``schema.py`` defines them at version 1; once a later migration alters a table,
migration 1 must keep creating the version-1 shape (freeze a copy of the old ``Table``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import Connection, Engine, inspect, select, text

from ddpscope.server import schema

logger = logging.getLogger(__name__)

_LOCK_KEY = 0x6464_7073  # "ddps": one advisory lock id for every collector on the database


def _initial(conn: Connection) -> None:
    schema.metadata.create_all(conn)


MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "initial schema: jobs, ranks, steps, collectives, heartbeats, events, counters", _initial),
]

LATEST = MIGRATIONS[-1][0]


def current_version(conn: Connection) -> int:
    if not inspect(conn).has_table("schema_version"):
        return 0
    return int(conn.execute(select(schema.schema_version.c.version)).scalar() or 0)


def migrate(engine: Engine) -> int:
    """Bring the database to ``LATEST``; return the version it was at. Safe to race."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        # On SQLite the writer engine opens every transaction with BEGIN IMMEDIATE: the lock is held.
        before = current_version(conn)
        if before > LATEST:
            raise RuntimeError(
                f"database schema version {before} is newer than this collector ({LATEST}); upgrade ddpscope"
            )
        for version, description, apply in MIGRATIONS:
            if version <= before:
                continue
            logger.info("applying migration %d: %s", version, description)
            apply(conn)
        if before == 0:
            conn.execute(schema.schema_version.insert().values(version=LATEST))
        elif before < LATEST:
            conn.execute(schema.schema_version.update().values(version=LATEST))
    return before
