"""Writing one decoded batch in one transaction: all of it or nothing.

Duplicates (same ``(job, rank, stream, seq)``) are skipped with ``ON CONFLICT DO NOTHING`` and
counted from the driver's row counts, per rank, so ``ranks.step_records`` stays exact under retries
and spool replays. Heartbeats and agent stats keep only the newest record per key (an upsert that
only moves forward). Hot rows shared by every batch of a job (``jobs``, ``counters``) are updated
last so their row locks are held for the shortest time when several collectors share PostgreSQL.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import msgspec
from sqlalchemy import Connection, case, func, literal_column
from sqlalchemy.dialects import postgresql, sqlite

from ddpscope.agent.records import is_shipper_stream
from ddpscope.server import schema
from ddpscope.server.codec import STRUCTS, kind_of
from ddpscope.server.rows import STEP_COLUMNS, block_rows, block_unused, encode_json, step_row

_json = msgspec.json.Encoder().encode

KEEP_COLLECTIVES = 20_000
"""Collectives kept per job and process group (the newest sequence numbers)."""
PRUNE_EVERY = 1_000
ROWS_PER_STATEMENT = (256, 16)
"""SQLite: step rows per multi-row INSERT, largest first (15 columns: 3,840 parameters at most, under
SQLite's 32,766); a batch's last rows go 16 at a time, not one by one."""


@dataclass(slots=True)
class WriteResult:
    accepted: int = 0
    duplicates: int = 0


def _insert(dialect: str, table: Any) -> Any:
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def _greatest(dialect: str, a: Any, b: Any) -> Any:
    # SQLite's two-argument max() is scalar; PostgreSQL spells it greatest().
    return func.greatest(a, b) if dialect == "postgresql" else func.max(a, b)


def _wire_text(record: Any) -> str:
    return _json(record).decode()


class BatchWriter:
    """Stateless apart from the job-id cache (ids never change once assigned)."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self._job_ids: dict[str, int] = {}
        placeholder = "%s" if dialect == "postgresql" else "?"
        # The hot path: step rows go to the driver as tuples, skipping per-row dict processing (the
        # statement is still the one schema.steps defines): SQLite in ROWS_PER_STATEMENT-row INSERTs.
        one = f"({', '.join([placeholder] * len(STEP_COLUMNS))})"
        insert = f"INSERT INTO steps ({', '.join(STEP_COLUMNS)}) VALUES %s ON CONFLICT DO NOTHING"
        self._steps_sql = insert % one
        self._steps_many_sql = [(k, insert % ", ".join([one] * k)) for k in ROWS_PER_STATEMENT]

    def write(self, conn: Connection, records: list[Any], now_ns: int) -> WriteResult:
        by_job: dict[str, list[Any]] = defaultdict(list)
        for r in records:
            by_job[r.job].append(r)
        result = WriteResult()
        for job in sorted(by_job):  # a fixed order: two batches never lock jobs in opposite orders
            self._write_job(conn, job, by_job[job], result)
        if result.accepted:
            self._bump(conn, "ingested_records", result.accepted)
        return result

    # -- one job --------------------------------------------------------------------------------
    def _write_job(self, conn: Connection, job: str, records: list[Any], result: WriteResult) -> None:
        by_kind: dict[str, list[Any]] = defaultdict(list)
        for r in records:
            by_kind[kind_of(r)].append(r)
        world_size = max((r.world_size for r in by_kind.get("rank_start", ())), default=0)
        last_seen = max(r.time_ns for r in records)
        first_seen = min(r.time_ns for r in records)
        job_id = self._job_id(conn, job, world_size, first_seen, last_seen)

        step_rows = _step_rows_by_rank(job_id, by_kind)
        step_counts = self._write_steps(conn, step_rows, result)
        self._write_unused(conn, job_id, by_kind)
        self._write_keyed(conn, job_id, by_kind, result)
        self._write_latest(conn, job_id, by_kind, result)
        self._write_ranks(conn, job_id, records, step_rows, step_counts)

    def _job_id(self, conn: Connection, job: str, world_size: int, first_ns: int, last_ns: int) -> int:
        row = {"job": job, "world_size": world_size, "first_seen_ns": first_ns, "last_seen_ns": last_ns}
        job_id = int(conn.execute(_job_upsert(self.dialect), row).scalar_one())
        self._job_ids[job] = job_id
        return job_id

    def _write_steps(
        self, conn: Connection, rows_by_rank: dict[int, list[tuple[Any, ...]]], result: WriteResult
    ) -> dict[int, int]:
        """Insert step rows rank by rank; return rows actually inserted per rank."""
        inserted: dict[int, int] = {}
        for rank in sorted(rows_by_rank):
            rows = rows_by_rank[rank]
            if self.dialect == "sqlite":
                n = self._insert_steps_sqlite(conn, rows)
            else:
                n = _copy_steps_pg(conn, rows)
            inserted[rank] = n
            result.accepted += n
            result.duplicates += len(rows) - n
        return inserted

    def _insert_steps_sqlite(self, conn: Connection, rows: list[tuple[Any, ...]]) -> int:
        n = at = 0
        for size, sql in self._steps_many_sql:  # the largest statements first, then smaller ones
            while len(rows) - at >= size:
                params = tuple(itertools.chain.from_iterable(rows[at : at + size]))
                n += conn.exec_driver_sql(sql, params).rowcount
                at += size
        if at < len(rows):  # fewer than the smallest: one row per execution
            n += conn.exec_driver_sql(self._steps_sql, rows[at:]).rowcount
        return n

    def _write_unused(self, conn: Connection, job_id: int, by_kind: dict[str, list[Any]]) -> None:
        found = [
            (r.rank, r.stream, r.seq, r.step, r.unused_parameters)
            for r in by_kind.get("step", ())
            if r.unused_parameters
        ]
        found += [
            (b.rank, b.stream, seq, step, names)
            for b in by_kind.get("step_block", ())
            for seq, step, names in block_unused(b)
        ]
        unused = [
            {
                "job_id": job_id,
                "rank": rank,
                "stream": stream,
                "seq": seq,
                "step": step,
                "names": encode_json(names),
            }
            for rank, stream, seq, step, names in found
        ]
        if unused:
            conn.execute(_insert_ignoring_conflicts(self.dialect, schema.step_unused), unused)

    def _insert_count(self, conn: Connection, table: Any, rows: list[dict[str, Any]]) -> int:
        """INSERT ... ON CONFLICT DO NOTHING of many rows; return how many were new."""
        stmt = _insert_ignoring_conflicts(self.dialect, table)
        if self.dialect == "sqlite":
            return int(conn.execute(stmt, rows).rowcount)  # sqlite3 sums executemany row counts
        # psycopg's executemany reports only the last statement's count: ask for the new rows back
        # (SQLAlchemy batches this into multi-row INSERT ... RETURNING statements).
        return len(conn.execute(_insert_returning_new(self.dialect, table), rows).all())

    def _insert_ignore(
        self, conn: Connection, table: Any, rows: list[dict[str, Any]], result: WriteResult
    ) -> None:
        if not rows:
            return
        n = self._insert_count(conn, table, rows)
        result.accepted += n
        result.duplicates += len(rows) - n

    def _write_keyed(
        self, conn: Connection, job_id: int, by_kind: dict[str, list[Any]], result: WriteResult
    ) -> None:
        def key(r: Any) -> dict[str, Any]:
            return {"job_id": job_id, "rank": r.rank, "stream": r.stream, "seq": r.seq}

        colls = [
            {**key(r), "time_ns": r.time_ns, "pg": r.pg, "coll_seq": r.coll_seq, "body": _wire_text(r)}
            for r in by_kind.get("collective", [])
        ]
        self._insert_ignore(conn, schema.collectives, colls, result)
        self._prune_collectives(conn, job_id, by_kind.get("collective", []))
        ends = [
            {**key(r), "time_ns": r.time_ns, "pg": r.pg, "coll_seq": r.coll_seq, "end_ns": r.end_ns, "ok": r.ok,
             # PostgreSQL text cannot hold NUL; free text keeps the rest (JSON bodies escape it).
             "error": r.error.replace("\x00", "\ufffd") if isinstance(r.error, str) else None}
            for r in by_kind.get("collective_end", [])
        ]  # fmt: skip
        self._insert_ignore(conn, schema.collective_ends, ends, result)
        events = [
            {**key(r), "kind": kind, "time_ns": r.time_ns, "body": _wire_text(r)}
            for kind in schema.EVENT_KINDS
            for r in by_kind.get(kind, [])
        ]
        self._insert_ignore(conn, schema.events, events, result)

    def _prune_collectives(self, conn: Connection, job_id: int, collectives: list[Any]) -> None:
        """Keep the last ``KEEP_COLLECTIVES`` sequence numbers per process group: the engine issues one
        collective per bucket per step, so an unbounded log would dwarf everything else. Ranks move in
        lockstep on a group, so no rank still needs what is dropped; the post-mortem needs the last."""
        span: dict[str, tuple[int, int]] = {}
        for r in collectives:
            lo, hi = span.get(r.pg, (r.coll_seq, r.coll_seq))
            span[r.pg] = (min(lo, r.coll_seq), max(hi, r.coll_seq))
        for pg, (lo, hi) in sorted(span.items()):
            # Prune when this batch crosses a multiple of PRUNE_EVERY: rarely, not on every batch.
            if hi <= KEEP_COLLECTIVES or (lo - 1) // PRUNE_EVERY == hi // PRUNE_EVERY:
                continue
            for t in (schema.collectives, schema.collective_ends):
                conn.execute(
                    t.delete().where(
                        t.c.job_id == job_id, t.c.pg == pg, t.c.coll_seq <= hi - KEEP_COLLECTIVES
                    )
                )

    def _write_latest(
        self, conn: Connection, job_id: int, by_kind: dict[str, list[Any]], result: WriteResult
    ) -> None:
        """Heartbeats (per rank) and agent stats (per rank and stream): only the newest is kept.

        A group counts as accepted when its newest record moved the stored one forward, else as
        duplicates (a re-sent batch); superseded records inside a batch share their newest's fate.
        """
        stmt = _latest_upsert(self.dialect, schema.heartbeats, ("job_id", "rank"), "time_ns")
        for group in _groups(by_kind.get("heartbeat", []), lambda r: r.rank, lambda r: (r.time_ns, r.seq)):
            r = group[-1]
            row = {"job_id": job_id, "rank": r.rank, "time_ns": r.time_ns, "body": _wire_text(r)}
            self._count_group(len(conn.execute(stmt, row).all()), len(group), result)

        stmt = _latest_upsert(self.dialect, schema.agent_stats, ("job_id", "rank", "stream"), "seq")
        for group in _groups(by_kind.get("agent_stats", []), lambda r: (r.rank, r.stream), lambda r: r.seq):
            r = group[-1]
            row = {"job_id": job_id, "rank": r.rank, "stream": r.stream, "seq": r.seq, "body": _wire_text(r)}
            self._count_group(len(conn.execute(stmt, row).all()), len(group), result)

    @staticmethod
    def _count_group(changed: int, n: int, result: WriteResult) -> None:
        # RETURNING, not rowcount: psycopg reports -1 for upserts run through SQLAlchemy.
        if changed > 0:
            result.accepted += n
        else:
            result.duplicates += n

    def _write_ranks(
        self,
        conn: Connection,
        job_id: int,
        records: list[Any],
        step_rows: dict[int, list[tuple[Any, ...]]],
        step_counts: dict[int, int],
    ) -> None:
        seen: dict[int, int] = {}
        for r in records:
            # Steps count from their rows; a shipper's records not at all: it outlives its rank, and a rank
            # seen after its peers lost it would not read as the one that died.
            if type(r) in _STEP_STRUCTS or is_shipper_stream(r.stream):
                continue
            if r.time_ns > seen.get(r.rank, -1):
                seen[r.rank] = r.time_ns
        # A rank's last step is the one it completed last, not the highest number: after a restart
        # (steps from 0 or a checkpoint again) it is the new process's progress. Ties: the later row.
        last: dict[int, tuple[Any, ...]] = {}
        for rank, group in step_rows.items():
            seen[rank] = max(seen.get(rank, -1), max(map(_row_time_ns, group)))
            last[rank] = max(reversed(group), key=_row_backward_end_ns)
        rows = [
            {
                "job_id": job_id,
                "rank": rank,
                "last_seen_ns": seen[rank],
                "step_records": step_counts.get(rank, 0),
                "last_step": last[rank][_STEP_INDEX] if rank in last else None,
                "last_step_end_ns": last[rank][_BACKWARD_END_INDEX] if rank in last else None,
            }
            for rank in sorted(seen)
        ]
        if not rows:
            return  # an empty executemany would run INSERT ... DEFAULT VALUES
        conn.execute(_ranks_upsert(self.dialect), rows)

    def _bump(self, conn: Connection, name: str, n: int) -> None:
        bump(conn, self.dialect, name, n)


_COLS = ", ".join(STEP_COLUMNS)
_STEP_STRUCTS = (STRUCTS["step"], STRUCTS["step_block"])
_STEP_INDEX = STEP_COLUMNS.index("step")
_BACKWARD_END_INDEX = STEP_COLUMNS.index("backward_end_ns")
_row_time_ns = itemgetter(STEP_COLUMNS.index("time_ns"))
_row_backward_end_ns = itemgetter(_BACKWARD_END_INDEX)


def _step_rows_by_rank(job_id: int, by_kind: dict[str, list[Any]]) -> dict[int, list[tuple[Any, ...]]]:
    """The batch's step rows per rank, from step records and step blocks alike, in arrival order."""
    out: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for r in by_kind.get("step", ()):
        out[r.rank].append(step_row(job_id, r))
    for b in by_kind.get("step_block", ()):
        out[b.rank] += block_rows(job_id, b)
    return out


def _copy_steps_pg(conn: Connection, rows: list[tuple[Any, ...]]) -> int:
    """PostgreSQL: COPY the rows into a session temp table, then one INSERT ... SELECT ... ON CONFLICT
    DO NOTHING whose row count is exact. COPY is several times faster than row-by-row INSERTs."""
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cur:
        cur.execute(
            "CREATE TEMP TABLE IF NOT EXISTS steps_incoming (LIKE steps INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        with cur.copy(f"COPY steps_incoming ({_COLS}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cur.execute(f"INSERT INTO steps ({_COLS}) SELECT {_COLS} FROM steps_incoming ON CONFLICT DO NOTHING")
        n = int(cur.rowcount)
        cur.execute("DELETE FROM steps_incoming")  # the next rank's group uses it in this transaction
    return n


def _groups(records: list[Any], key: Any, order: Any) -> list[list[Any]]:
    """Records grouped by ``key``, each group sorted by ``order`` (newest last)."""
    groups: dict[Any, list[Any]] = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    return [sorted(g, key=order) for _, g in sorted(groups.items())]


def bump(conn: Connection, dialect: str, name: str, n: int) -> None:
    """Add ``n`` to a counter row (created on first use)."""
    conn.execute(_counter_bump(dialect), {"name": name, "value": n})


# -- statements -------------------------------------------------------------------------------------
# Built once per dialect: constructing an upsert (its ``excluded`` proxy copies every column) costs more
# than executing it, and every batch runs several. Values come as parameters at execution.


@functools.cache
def _job_upsert(dialect: str) -> Any:
    t = schema.jobs
    stmt = _insert(dialect, t)
    return stmt.on_conflict_do_update(
        index_elements=[t.c.job],
        set_={
            "last_seen_ns": _greatest(dialect, t.c.last_seen_ns, stmt.excluded.last_seen_ns),
            "world_size": _greatest(dialect, t.c.world_size, stmt.excluded.world_size),
        },
    ).returning(t.c.id)


@functools.cache
def _insert_ignoring_conflicts(dialect: str, table: Any) -> Any:
    return _insert(dialect, table).on_conflict_do_nothing()


@functools.cache
def _insert_returning_new(dialect: str, table: Any) -> Any:
    return _insert_ignoring_conflicts(dialect, table).returning(table.c.seq)


@functools.cache
def _latest_upsert(dialect: str, table: Any, keys: tuple[str, ...], by: str) -> Any:
    """Insert, or replace the stored row of the same ``keys`` when ``by`` moved forward; returns a row
    only when something changed."""
    stmt = _insert(dialect, table)
    return stmt.on_conflict_do_update(
        index_elements=[table.c[k] for k in keys],
        set_={by: stmt.excluded[by], "body": stmt.excluded.body},
        where=stmt.excluded[by] > table.c[by],
    ).returning(table.c.rank)


@functools.cache
def _ranks_upsert(dialect: str) -> Any:
    t = schema.ranks
    stmt = _insert(dialect, t)
    ex = stmt.excluded
    newer = ex.last_step.is_not(None) & (
        t.c.last_step_end_ns.is_(None) | (ex.last_step_end_ns >= t.c.last_step_end_ns)
    )
    return stmt.on_conflict_do_update(
        index_elements=[t.c.job_id, t.c.rank],
        set_={
            "last_seen_ns": _greatest(dialect, t.c.last_seen_ns, ex.last_seen_ns),
            "step_records": t.c.step_records + ex.step_records,
            "last_step": case((newer, ex.last_step), else_=t.c.last_step),
            "last_step_end_ns": case((newer, ex.last_step_end_ns), else_=t.c.last_step_end_ns),
        },
    )


@functools.cache
def _counter_bump(dialect: str) -> Any:
    t = schema.counters
    return _insert(dialect, t).on_conflict_do_update(
        index_elements=[t.c.name], set_={"value": t.c.value + literal_column("excluded.value")}
    )
