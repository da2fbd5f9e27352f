"""The collector's tables (SQLAlchemy Core), at the newest schema version.

Layout choices, for ingest speed and a small database:

- Jobs are interned: every other table carries an integer ``job_id``, not the job name.
- ``steps``: one row per rank per step; the six per-bucket arrays are packed into one msgpack blob
  (``arrays``), not one row per bucket. Scalars used by queries stay columns. Indexed by
  ``(job_id, step, rank)`` for step windows and by the idempotency key.
- ``step_unused``: the unused-parameter names of a step, only for steps that had any, so the
  unused-parameter aggregate never scans ``steps``.
- ``collectives`` / ``collective_ends``: inserts only (an end never updates its collective row);
  joined on read by ``(job_id, rank, stream, pg, coll_seq)``.
- ``heartbeats`` and ``agent_stats`` keep only the latest record per rank (per stream for agent
  stats, whose counters are cumulative per stream): upserts that only move forward.
- ``events``: the rare, read-whole kinds (rank_start, layout, hang, hang_resolved, rank_error,
  rank_exit, warning, replica_digest, memory, stall_sample, site_profile) as the wire JSON, indexed by kind and
  time. They are a handful per rank (``memory``: one every 30 s, read an hour back at most; ``stall_sample``:
  at most a few every 5 s, read from the window ``/stalls`` looks at; ``site_profile``: one a minute, read
  back a few minutes); a table per kind would add schema without a query that needs it.
- ``ranks``: per rank, the newest time seen and step progress, maintained at ingest so job lists and
  /metrics never aggregate ``steps``.
- ``counters``: the collector's own counters (ingested records, rejected batches by reason), in the
  database so several collector processes add up.

Every record table has a unique idempotency key ``(job_id, rank, stream, seq)``; inserts are
``ON CONFLICT DO NOTHING``.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

EVENT_KINDS = (
    "rank_start",
    "layout",
    "hang",
    "hang_resolved",
    "rank_error",
    "rank_exit",
    "warning",
    "replica_digest",
    "memory",
    "stall_sample",
    "site_profile",
)


def _key(table: str) -> UniqueConstraint:
    return UniqueConstraint("job_id", "rank", "stream", "seq", name=f"uq_{table}_key")


schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))

jobs = Table(
    "jobs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job", String(200), nullable=False, unique=True),
    Column("world_size", Integer, nullable=False, server_default="0"),
    Column("first_seen_ns", BigInteger, nullable=False),
    Column("last_seen_ns", BigInteger, nullable=False),
)

ranks = Table(
    "ranks",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("last_seen_ns", BigInteger, nullable=False),
    Column("step_records", BigInteger, nullable=False, server_default="0"),
    Column("last_step", BigInteger, nullable=True),
    Column("last_step_end_ns", BigInteger, nullable=True),
    PrimaryKeyConstraint("job_id", "rank"),
)

steps = Table(
    "steps",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("time_ns", BigInteger, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("synced", Boolean, nullable=False),
    Column("forward_start_ns", BigInteger, nullable=False),
    Column("forward_end_ns", BigInteger, nullable=False),
    Column("backward_start_ns", BigInteger, nullable=False),
    Column("backward_end_ns", BigInteger, nullable=False),
    Column("arrays", LargeBinary, nullable=False),
    # Time blocked in collectives other than the gradient all-reduces, by phase (migration 3).
    Column("blocked_between_ns", BigInteger, nullable=False, server_default="0"),
    Column("blocked_forward_ns", BigInteger, nullable=False, server_default="0"),
    Column("blocked_backward_ns", BigInteger, nullable=False, server_default="0"),
    _key("steps"),
    Index("ix_steps_job_step_rank", "job_id", "step", "rank"),
)

step_unused = Table(
    "step_unused",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("names", Text, nullable=False),
    _key("step_unused"),
)

collectives = Table(
    "collectives",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("time_ns", BigInteger, nullable=False),
    Column("pg", String(200), nullable=False),
    Column("coll_seq", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    _key("collectives"),
    Index("ix_collectives_job_pg_seq", "job_id", "pg", "coll_seq"),
)

collective_ends = Table(
    "collective_ends",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("time_ns", BigInteger, nullable=False),
    Column("pg", String(200), nullable=False),
    Column("coll_seq", BigInteger, nullable=False),
    Column("end_ns", BigInteger, nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("error", Text, nullable=True),
    _key("collective_ends"),
    Index("ix_collective_ends_job_pg_seq", "job_id", "pg", "coll_seq"),
)

heartbeats = Table(
    "heartbeats",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("time_ns", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    PrimaryKeyConstraint("job_id", "rank"),
)

agent_stats = Table(
    "agent_stats",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    PrimaryKeyConstraint("job_id", "rank", "stream"),
)

events = Table(
    "events",
    metadata,
    Column("job_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("stream", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("time_ns", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    _key("events"),
    Index("ix_events_job_kind_time", "job_id", "kind", "time_ns"),
)

counters = Table(
    "counters",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("value", BigInteger, nullable=False),
)
