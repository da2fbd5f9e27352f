"""Schema versioning: ordered migrations applied on start, under a lock, recorded in ``schema_version``.

Why not Alembic: the collector creates its own schema on start with no operator step, on SQLite and
PostgreSQL alike, and several collector processes may start at once against one PostgreSQL. A short
ordered list of functions, each run in the same transaction that bumps the version, under a database
lock (``pg_advisory_xact_lock`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), gives exactly that.

Rules for adding a migration: append ``(version, description, function)``; never edit one that has
shipped; a function receives the open connection and uses SQLAlchemy Core / DDL. Migration 1 creates
the tables as ``schema.py`` defines them today, so a migration that adds columns adds only those a
table lacks (a fresh database already has them); one that changes a table in any other way must
freeze a copy of the old ``Table`` for migration 1 instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from sqlalchemy import Connection, Engine, and_, bindparam, inspect, select, text, tuple_

from ddpscope.agent import records as wire
from ddpscope.server import schema

logger = logging.getLogger(__name__)

_LOCK_KEY = 0x6464_7073  # "ddps": one advisory lock id for every collector on the database


def _initial(conn: Connection) -> None:
    schema.metadata.create_all(conn)


def _repack_step_arrays(conn: Connection) -> None:
    """Version 1 stored a step's six arrays as msgpack; version 2 stores the wire format's packed blob,
    so a step the agent sends packed is stored without being unpacked. Pages through the unique key."""
    from_msgpack = msgspec.msgpack.Decoder(tuple[list[int], ...]).decode
    t = schema.steps
    key = (t.c.job_id, t.c.rank, t.c.stream, t.c.seq)
    update = (
        t.update()
        .where(and_(*(c == bindparam(f"k_{c.name}") for c in key)))
        .values(arrays=bindparam("packed"))
    )
    last: tuple[object, ...] | None = None
    while True:
        query = select(*key, t.c.arrays).order_by(*key).limit(5000)
        if last is not None:
            query = query.where(tuple_(*key) > tuple_(*last))
        rows = conn.execute(query).all()
        if not rows:
            return
        conn.execute(
            update,
            [
                {
                    **{f"k_{c.name}": v for c, v in zip(key, row[:4], strict=True)},
                    "packed": wire.pack_step_arrays(from_msgpack(row[4])),
                }
                for row in rows
            ],
        )
        last = tuple(rows[-1][:4])


def _add_missing_columns(table_name: str) -> Callable[[Connection], None]:
    """A migration that adds the columns ``schema.py`` gives ``table_name`` and the table lacks; each
    must be nullable or have a server default (existing rows take it)."""

    def apply(conn: Connection) -> None:
        table = schema.metadata.tables[table_name]
        have = {c["name"] for c in inspect(conn).get_columns(table_name)}
        for column in table.columns:
            if column.name in have:
                continue
            ddl = f"ALTER TABLE {table_name} ADD COLUMN {column.name} {column.type.compile(conn.dialect)}"
            if column.server_default is not None:
                ddl += f" NOT NULL DEFAULT {column.server_default.arg}"  # type: ignore[attr-defined]
            conn.execute(text(ddl))

    return apply


MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "initial schema: jobs, ranks, steps, collectives, heartbeats, events, counters", _initial),
    (2, "steps.arrays: msgpack lists -> the wire format's packed int64 blob", _repack_step_arrays),
    (
        3,
        "steps: time blocked in other collectives, by phase (0 for older rows)",
        _add_missing_columns("steps"),
    ),
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
