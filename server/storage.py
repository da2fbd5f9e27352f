"""The collector's storage: one class over SQLite or PostgreSQL (SQLAlchemy Core).

Nothing but the database holds state (the job-id cache is only a cache), so several collector
processes can share one PostgreSQL. Writes: ``write_batch(records)`` stores a decoded batch in one
transaction (all or nothing) and returns ``WriteResult(accepted, duplicates)``. Schema: see
``schema.py``; versioning: ``migrations.py``.

Read API (what routes, /metrics and the analysis modules use):

- ``fetch_records(job, kinds=(...), rank=None) -> list[dict]``: **wire-shaped** dicts (exactly the
  field names of ``ddpscope.agent.records``) of the given kinds, ordered by ``time_ns``. ``heartbeat``
  and ``agent_stats`` give only the latest per rank (per stream for agent stats): older ones are not
  kept. ``collective`` and ``collective_end`` are the records as sent (not merged); ``step`` records
  come back with their arrays unpacked (use ``steps()`` for windows).
- ``load_snapshot(job) -> JobSnapshot | None``: everything status/incident analysis needs (see
  ``analysis/snapshot.py`` for the shape), collectives merged with their ends.
- ``jobs() -> list[JobRow]``, ``job_row(job)``: the job table plus per-rank progress (``RankRow``).
- ``steps(job_id, rank=, start=, end=, limit=, after=) -> list[StepRow]``: step rows ordered by
  ``(step, rank)``, with unpacked arrays (``rows.StepRow``); ``step_page(...)`` the same rows as columns with
  only what per-step metrics and straggler scoring read (``step_page.StepPage``); ``recent_steps(job_id, n)``
  the last ``n`` step numbers (``recent_step_page`` as columns). Every step view reads only each restarted
  rank's latest attempt (``_latest_attempt``): after a restart (step, rank) repeats, and the views are about
  the current processes.
- ``unused_rows(job_id)``: ``(rank, step, names)`` for every step that had unused parameters.
- ``counters()``, ``count(name, n)``: the collector's own counters (e.g. ``rejected_batches:too_large``).
- ``ping()``: True when the database answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, or_, select, true
from sqlalchemy.exc import DBAPIError

from ddpscope.agent.records import RECORD_KINDS
from ddpscope.server import schema
from ddpscope.server.analysis.snapshot import (
    COLLECTIVE_WINDOW,
    MEMORY_WINDOW_NS,
    STALL_SAMPLES,
    JobSnapshot,
    RankSteps,
    attempt_starts,
    current_process_reports,
    merge_collectives,
    settle_world,
    stream_seen,
)
from ddpscope.server.analysis.unused import aggregate_unused
from ddpscope.server.engines import Engines, make_engines
from ddpscope.server.migrations import migrate
from ddpscope.server.rows import STEP_COLUMNS, StepRow, decode_json
from ddpscope.server.step_page import SCALARS as PAGE_SCALARS
from ddpscope.server.step_page import StepPage
from ddpscope.server.writer import BatchWriter, WriteResult, bump

logger = logging.getLogger(__name__)

ALL_KINDS = tuple(kind for kind in RECORD_KINDS if kind != "step_block")
"""Every kind of the wire format is stored (the events table takes the rare ones, ``schema.EVENT_KINDS``);
a ``step_block`` is stored as the step records it stands for."""

# Every step column but job_id, in the order of a step row tuple (rows.STEP_COLUMNS).
_STEP_COLS = [schema.steps.c[name] for name in STEP_COLUMNS if name != "job_id"]
# What a StepPage reads, in its order.
_PAGE_COLS = [schema.steps.c[name] for name in (*PAGE_SCALARS, "arrays")]


@dataclass(slots=True)
class RankRow:
    rank: int
    last_seen_ns: int
    step_records: int
    last_step: int | None
    last_step_end_ns: int | None


@dataclass(slots=True)
class JobRow:
    id: int
    job: str
    world_size: int
    first_seen_ns: int
    last_seen_ns: int
    ranks: list[RankRow] = field(default_factory=list)


class Storage:
    """Open with ``Storage.open(url)`` (creates or migrates the schema); ``close()`` at shutdown."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.opened_s = time.time()
        """This collector's start: liveness gives ranks last heard before it time to catch up."""
        self.dialect = engines.dialect
        self._writer = BatchWriter(engines.dialect)
        self.write_failure: tuple[float, str] | None = None
        """(when, why) of the last batch the database refused to write (a full disk, a lock held
        elsewhere, a file deleted under it), until a batch is written again: ``/healthz`` reports it,
        since the database may still answer reads."""
        self._job_ids: dict[str, int] = {}
        self._deferred: dict[str, int] = {}
        self._deferred_lock = threading.Lock()

    @classmethod
    def open(cls, url: str, *, pool_size: int = 8) -> Storage:
        engines = make_engines(url, pool_size=pool_size)
        before = migrate(engines.writer)
        logger.info(
            "storage %s ready (schema was at version %d)", engines.writer.url.render_as_string(), before
        )
        return cls(engines)

    def close(self) -> None:
        self.engines.dispose()

    # -- writes ---------------------------------------------------------------------------------
    def write_batch(self, records: list[Any]) -> WriteResult:
        """Store decoded records (``codec`` Structs) in one transaction; commit before returning."""
        deferred = self._take_deferred()
        try:
            with self.engines.writer.begin() as conn:
                result = self._writer.write(conn, records, time.time_ns())
                for name, n in sorted(deferred.items()):
                    bump(conn, self.dialect, name, n)
        except BaseException as e:
            self.defer_count_many(deferred)
            if isinstance(e, (DBAPIError, OSError)):
                # The driver's own words (sqlite3's "database or disk is full"), not SQLAlchemy's wrapper.
                cause = getattr(e, "orig", None) or e
                self.write_failure = (
                    time.time(),
                    str(cause).strip().splitlines()[0][:300] or type(cause).__name__,
                )
            raise
        self.write_failure = None
        self.engines.committed()
        return result

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter now, in its own transaction."""
        with self.engines.writer.begin() as conn:
            bump(conn, self.dialect, name, n)

    def defer_count(self, name: str, n: int = 1) -> None:
        """Add to a counter with the next write (used under overload, when a write of its own would
        compete for the very lock that is overloaded)."""
        self.defer_count_many({name: n})

    def defer_count_many(self, counts: dict[str, int]) -> None:
        with self._deferred_lock:
            for name, n in counts.items():
                self._deferred[name] = self._deferred.get(name, 0) + n

    def flush_counts(self) -> None:
        deferred = self._take_deferred()
        if not deferred:
            return
        try:
            with self.engines.writer.begin() as conn:
                for name, n in sorted(deferred.items()):
                    bump(conn, self.dialect, name, n)
        except BaseException:
            self.defer_count_many(deferred)
            raise

    def _take_deferred(self) -> dict[str, int]:
        with self._deferred_lock:
            taken, self._deferred = self._deferred, {}
        return taken

    # -- reads ----------------------------------------------------------------------------------
    def ping(self) -> bool:
        with self.engines.reader.connect() as conn:
            return conn.exec_driver_sql("SELECT 1").scalar() == 1

    def counters(self) -> dict[str, int]:
        with self.engines.reader.connect() as conn:
            return {r.name: int(r.value) for r in conn.execute(select(schema.counters))}

    def job_id(self, job: str) -> int | None:
        if job in self._job_ids:
            return self._job_ids[job]
        with self.engines.reader.connect() as conn:
            found = conn.execute(select(schema.jobs.c.id).where(schema.jobs.c.job == job)).scalar()
        if found is not None:
            self._job_ids[job] = int(found)
        return None if found is None else int(found)

    def jobs(self) -> list[JobRow]:
        with self.engines.reader.connect() as conn:
            jobs = {
                r.id: JobRow(r.id, r.job, r.world_size, r.first_seen_ns, r.last_seen_ns)
                for r in conn.execute(select(schema.jobs).order_by(schema.jobs.c.last_seen_ns.desc()))
            }
            for r in conn.execute(select(schema.ranks).order_by(schema.ranks.c.rank)):
                if r.job_id in jobs:
                    jobs[r.job_id].ranks.append(_rank_row(r))
        return list(jobs.values())

    def job_row(self, job: str) -> JobRow | None:
        job_id = self.job_id(job)
        if job_id is None:
            return None
        with self.engines.reader.connect() as conn:
            r = conn.execute(select(schema.jobs).where(schema.jobs.c.id == job_id)).one()
            row = JobRow(r.id, r.job, r.world_size, r.first_seen_ns, r.last_seen_ns)
            t = schema.ranks
            row.ranks = [
                _rank_row(x) for x in conn.execute(select(t).where(t.c.job_id == job_id).order_by(t.c.rank))
            ]
        return row

    def steps(
        self,
        job_id: int,
        *,
        rank: int | None = None,
        start: int | None = None,
        end: int | None = None,
        limit: int | None = None,
        after: tuple[int, int] | None = None,
        every_attempt: bool = False,
    ) -> list[StepRow]:
        """Step rows with ``start <= step <= end``, ordered by (step, rank), after the cursor ``after``:
        of each rank's latest attempt only (see ``_latest_attempt``), unless ``every_attempt``."""
        with self.engines.reader.connect() as conn:
            attempt = None if every_attempt else _latest_attempt(schema.steps, _restarts(conn, job_id))
            q = self._steps_query(job_id, rank, start, end, limit, after, attempt)
            return [StepRow.from_db(r) for r in conn.execute(q).all()]

    def step_page(
        self,
        job_id: int,
        *,
        rank: int | None = None,
        start: int | None = None,
        end: int | None = None,
        limit: int | None = None,
        after: tuple[int, int] | None = None,
    ) -> StepPage:
        """The rows of ``steps`` as one ``StepPage``: columns decoded with numpy, only what the step views
        read (``tests/server/test_storage.py`` checks it against ``steps``)."""
        with self.engines.reader.connect() as conn:
            attempt = _latest_attempt(schema.steps, _restarts(conn, job_id))
            q = self._steps_query(job_id, rank, start, end, limit, after, attempt, _PAGE_COLS)
            return StepPage.from_db(conn.execute(q).all())

    @staticmethod
    def _steps_query(
        job_id: int,
        rank: int | None,
        start: int | None,
        end: int | None,
        limit: int | None,
        after: tuple[int, int] | None,
        attempt: Any,
        columns: list[Any] = _STEP_COLS,
    ) -> Any:
        t = schema.steps
        q = select(*columns).where(t.c.job_id == job_id)
        if attempt is not None:
            q = q.where(attempt)
        if rank is not None:
            q = q.where(t.c.rank == rank)
        if start is not None:
            q = q.where(t.c.step >= start)
        if end is not None:
            q = q.where(t.c.step <= end)
        if after is not None:
            q = q.where(or_(t.c.step > after[0], and_(t.c.step == after[0], t.c.rank > after[1])))
        q = q.order_by(t.c.step, t.c.rank, t.c.seq)
        if limit is not None:
            q = q.limit(limit)
        return q

    def last_step(self, job_id: int) -> int | None:
        with self.engines.reader.connect() as conn:
            value = conn.execute(
                select(func.max(schema.ranks.c.last_step)).where(schema.ranks.c.job_id == job_id)
            ).scalar()
        return None if value is None else int(value)

    def recent_steps(self, job_id: int, n: int) -> list[StepRow]:
        """Rows of the last ``n`` step numbers (every rank)."""
        last = self.last_step(job_id)
        return [] if last is None else self.steps(job_id, start=last - n + 1, end=last)

    def recent_step_page(self, job_id: int, n: int) -> StepPage:
        """``recent_steps`` as a ``StepPage``: what per-step metrics and straggler scoring read."""
        last = self.last_step(job_id)
        return StepPage.from_db([]) if last is None else self.step_page(job_id, start=last - n + 1, end=last)

    def unused_rows(self, job_id: int) -> list[tuple[int, int, list[str]]]:
        """``(rank, step, names)`` of the steps of each rank's latest attempt that had unused parameters
        (a restart that fixed the code path must not keep reporting the old one)."""
        t, s = schema.step_unused, schema.steps
        with self.engines.reader.connect() as conn:
            q = select(t.c.rank, t.c.step, t.c.names).where(t.c.job_id == job_id)
            attempt = _latest_attempt(s, _restarts(conn, job_id))
            if attempt is not None:  # the step row has the time the attempt test needs; few rows join
                key = [t.c[k] == s.c[k] for k in ("job_id", "rank", "stream", "seq")]
                q = q.where(select(s.c.seq).where(*key, attempt).exists())
            return [(r.rank, r.step, decode_json(r.names)) for r in conn.execute(q)]

    def fetch_records(
        self, job: str, kinds: Iterable[str] = ALL_KINDS, *, rank: int | None = None
    ) -> list[dict[str, Any]]:
        """Wire-shaped records of ``job`` of the given kinds, ordered by time_ns (see module doc)."""
        kinds = tuple(kinds)
        unknown = set(kinds) - set(ALL_KINDS)
        if unknown:
            raise ValueError(f"kinds: unknown record kinds {sorted(unknown)}")
        job_id = self.job_id(job)
        if job_id is None:
            return []
        out: list[dict[str, Any]] = []
        with self.engines.reader.connect() as conn:
            event_kinds = [k for k in kinds if k in schema.EVENT_KINDS]
            for table, wanted in (
                (schema.events, event_kinds),
                (schema.heartbeats, "heartbeat" in kinds),
                (schema.agent_stats, "agent_stats" in kinds),
                (schema.collectives, "collective" in kinds),
            ):
                if not wanted:
                    continue
                q = select(table.c.body).where(table.c.job_id == job_id)
                if table is schema.events:
                    q = q.where(table.c.kind.in_(event_kinds))
                if rank is not None:
                    q = q.where(table.c.rank == rank)
                out.extend(decode_json(r.body) for r in conn.execute(q))
            if "collective_end" in kinds:
                t = schema.collective_ends
                q = select(t).where(t.c.job_id == job_id)
                if rank is not None:
                    q = q.where(t.c.rank == rank)
                out.extend(_end_wire(job, r) for r in conn.execute(q))
        if "step" in kinds:
            unused = {(r[0], r[1]): r[2] for r in self.unused_rows(job_id)}
            for s in self.steps(job_id, rank=rank, every_attempt=True):  # as stored: every attempt
                s.unused_parameters = unused.get((s.rank, s.step), [])
                out.append(s.to_wire(job))
        out.sort(key=lambda r: (r["time_ns"], r["rank"], r["seq"]))
        return out

    def stop_reports(self, job: str) -> list[dict[str, Any]]:
        """The ``hang``, ``hang_resolved``, ``rank_error`` and ``rank_exit`` records of each rank's current
        process (``snapshot.current_process_reports``), oldest first: what ``analysis/stops.py`` reads. A
        restarted rank's reports from before the restart describe a step that was run again, or one the
        relaunch never reached."""
        return current_process_reports(
            job, self.fetch_records(job, ["rank_start", "hang", "hang_resolved", "rank_error", "rank_exit"])
        )

    def load_snapshot(self, job: str) -> JobSnapshot | None:
        """See ``analysis/snapshot.py``."""
        row = self.job_row(job)
        if row is None:
            return None
        recs = self.fetch_records(
            job,
            [
                k
                for k in ALL_KINDS
                if k not in ("step", "collective", "collective_end", "memory", "stall_sample", "site_profile")
            ],
        )
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for r in recs:
            by_kind.setdefault(r["kind"], []).append(r)
        current = {r["stream"] for r in latest_by_rank(by_kind.get("rank_start", [])).values()}
        colls, ends = self._collective_window(job, row.id, current)
        steps = {
            r.rank: RankSteps(r.rank, r.step_records, r.last_step, r.last_step_end_ns or 0)
            for r in row.ranks
            if r.last_step is not None
        }
        latest = latest_by_rank
        snap = JobSnapshot(
            job=job,
            world_size=0,
            ranks=latest(by_kind.get("rank_start", [])),
            layouts=by_kind.get("layout", []),
            heartbeats=latest(by_kind.get("heartbeat", [])),
            hangs=by_kind.get("hang", []),
            hang_resolved=by_kind.get("hang_resolved", []),
            rank_errors=by_kind.get("rank_error", []),
            rank_exits=by_kind.get("rank_exit", []),
            warnings=by_kind.get("warning", []),
            digests=by_kind.get("replica_digest", []),
            memory=self.memory_window(row.id),
            stall_samples=self.newest_stall_samples(row.id),
            collectives=merge_collectives(colls, ends),
            steps=steps,
            unused=aggregate_unused(self.unused_rows(row.id)),
            agent_stats=latest(by_kind.get("agent_stats", [])),
            rank_last_seen_s={r.rank: r.last_seen_ns / 1e9 for r in row.ranks},
            listening_since_s=self.opened_s,
            starts=by_kind.get("rank_start", []),
            stream_seen_ns=stream_seen(by_kind.get("agent_stats", [])),
        )
        # Not the jobs row's world size, the largest ever declared: a relaunch may have fewer ranks.
        return settle_world(snap)

    def events_since(self, job_id: int, kind: str, since_ns: int) -> list[dict[str, Any]]:
        """The job's records of one of ``schema.EVENT_KINDS`` from ``since_ns`` on (``stall_sample``: the steps
        ``/stalls`` looks at), oldest first: one query on the events' (job, kind, time) index."""
        t = schema.events
        q = (
            select(t.c.body)
            .where(t.c.job_id == job_id, t.c.kind == kind, t.c.time_ns >= since_ns)
            .order_by(t.c.time_ns)
        )
        with self.engines.reader.connect() as conn:
            return [decode_json(r.body) for r in conn.execute(q)]

    def newest_stall_samples(self, job_id: int) -> list[dict[str, Any]]:
        """The job's newest ``STALL_SAMPLES`` ``stall_sample`` records, oldest first."""
        t = schema.events
        q = (
            select(t.c.body)
            .where(t.c.job_id == job_id, t.c.kind == "stall_sample")
            .order_by(t.c.time_ns.desc())
            .limit(STALL_SAMPLES)
        )
        with self.engines.reader.connect() as conn:
            return [decode_json(r.body) for r in conn.execute(q)][::-1]

    def memory_window(self, job_id: int) -> list[dict[str, Any]]:
        """The job's ``memory`` records of the ``MEMORY_WINDOW_NS`` up to its newest, oldest first: two
        queries on the events' (job, kind, time) index, however long the job ran."""
        t = schema.events
        of_job = (t.c.job_id == job_id, t.c.kind == "memory")
        with self.engines.reader.connect() as conn:
            newest = conn.execute(select(func.max(t.c.time_ns)).where(*of_job)).scalar()
            if newest is None:
                return []
            q = (
                select(t.c.body)
                .where(*of_job, t.c.time_ns >= newest - MEMORY_WINDOW_NS)
                .order_by(t.c.time_ns)
            )
            return [decode_json(r.body) for r in conn.execute(q)]

    def _collective_window(
        self, job: str, job_id: int, current_streams: set[str]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Per process group, the last ``COLLECTIVE_WINDOW`` sequence numbers of the ranks' current
        processes (``current_streams``, from their latest ``rank_start``), and separately of the
        processes before a restart: a restarted rank numbers from 1 again, and the old processes'
        higher numbers must not push the new ones out of the window."""
        c, e = schema.collectives, schema.collective_ends
        groups: list[tuple[Any, Any]] = [(true(), true())]
        if current_streams:
            groups = [
                (c.c.stream.in_(current_streams), e.c.stream.in_(current_streams)),
                (c.c.stream.not_in(current_streams), e.c.stream.not_in(current_streams)),
            ]
        colls: list[dict[str, Any]] = []
        ends: list[dict[str, Any]] = []
        with self.engines.reader.connect() as conn:
            for of_colls, of_ends in groups:
                tops = conn.execute(
                    select(c.c.pg, func.max(c.c.coll_seq))
                    .where(c.c.job_id == job_id, of_colls)
                    .group_by(c.c.pg)
                ).all()
                for pg, top in tops:
                    lo = int(top) - COLLECTIVE_WINDOW
                    q = select(c.c.body).where(
                        c.c.job_id == job_id, of_colls, c.c.pg == pg, c.c.coll_seq > lo
                    )
                    colls.extend(decode_json(r.body) for r in conn.execute(q))
                    q2 = select(e).where(e.c.job_id == job_id, of_ends, e.c.pg == pg, e.c.coll_seq > lo)
                    ends.extend(_end_wire(job, r) for r in conn.execute(q2))
        return colls, ends


def _rank_row(r: Any) -> RankRow:
    return RankRow(r.rank, r.last_seen_ns, r.step_records, r.last_step, r.last_step_end_ns)


def _restarts(conn: Any, job_id: int) -> dict[int, tuple[str | None, int]]:
    """``analysis.snapshot.attempt_starts`` of the job's ``rank_start`` records: per rank that restarted
    or that the newest launch left out, where its latest attempt starts. A handful of indexed rows per
    rank."""
    e = schema.events
    q = select(e.c.body).where(e.c.job_id == job_id, e.c.kind == "rank_start")
    return attempt_starts(decode_json(r.body) for r in conn.execute(q))


def _latest_attempt(t: Any, restarts: dict[int, tuple[str | None, int]]) -> Any:
    """A WHERE clause keeping the rows of ``t`` (rank, stream, time_ns) that belong to each restarted
    rank's latest attempt, as ``analysis.snapshot.split_restart`` divides records: on the stream of
    its latest ``rank_start``, or not older than it (a reconfigured agent's new stream). None when no
    rank restarted: nothing to filter, and the hot path stays as it was.

    Row by row: ranks that never restarted and rows on a current stream pass on cheap tests (an IN
    list is a lookup); only rows of other streams at or after the earliest restart reach the per-rank
    time test, so the clause costs no more than a constant per row however many ranks restarted."""
    if not restarts:
        return None
    earliest = min(ns for _, ns in restarts.values())
    return or_(
        t.c.rank.not_in(sorted(restarts)),
        t.c.stream.in_(sorted({stream for stream, _ in restarts.values() if stream is not None})),
        and_(
            t.c.time_ns >= earliest,
            or_(*(and_(t.c.rank == rank, t.c.time_ns >= ns) for rank, (_, ns) in sorted(restarts.items()))),
        ),
    )


def latest_by_rank(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's latest of ``records`` (as ``fetch_records`` returns them, ordered by time): a restarted rank
    sends a ``rank_start`` per incarnation."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:  # ordered by time_ns: the last one wins
        out[r["rank"]] = r
    return out


def _end_wire(job: str, r: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "collective_end",
        "job": job,
        "rank": r.rank,
        "stream": r.stream,
        "seq": r.seq,
        "pg": r.pg,
        "coll_seq": r.coll_seq,
        "end_ns": r.end_ns,
        "ok": bool(r.ok),
        "time_ns": r.time_ns,
    }
    if r.error is not None:  # optional on the wire: absent and null mean the same
        out["error"] = r.error
    return out
