"""The agent object and the module-level API: ``emit``, ``configure``, ``get_agent``, ``shutdown``.

``emit(record)`` does no serialization and no system call for ordinary records: it appends
``(now_ns(), record)`` to the worker's bounded deque (or counts a drop). The worker thread stamps the
envelope (job, rank, stream, seq, time_ns), checks the record, hands batches to the exporter (the spool
write, in rounds) and sends the cumulative ``agent_stats``. Urgent kinds (``emit``) and collective
records (``emit_durable``) are stamped in the caller instead and copied into the spool exporter's
memory-mapped write-ahead ring, crash-durable when the call returns (a few microseconds); urgent
kinds also wake the worker at once.

The caller keeps ownership of the dict it emits; the agent never writes to it (the collective
recorder shares its records with the hang watchdog). An ordinary record is copied on the worker
thread, so a caller must not mutate a record after emitting it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
import time
import uuid
from typing import Any

from ddpscope.agent import lifecycle
from ddpscope.agent._errors import swallowed
from ddpscope.agent.clock import now_ns
from ddpscope.agent.config import Config, group_rank
from ddpscope.agent.exporters import Exporter, ExportResult, InMemoryExporter
from ddpscope.agent.implied import IMPLIES_KEY, Implies, implied_records
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import ENVELOPE, RECORD_KINDS, URGENT_KINDS, RecordError, validate_record
from ddpscope.agent.ring import SLOTS, encode_template, fill
from ddpscope.agent.template import RecordTemplate

logger = get_logger(__name__)

__all__ = [
    "Agent",
    "ExportResult",
    "InMemoryExporter",
    "configure",
    "emit",
    "emit_durable",
    "emit_templated",
    "make_durable",
    "get_agent",
    "shutdown",
]


FULL_CHECKS = 16
"""Records of each kind checked field by field before switching to sampling."""
DURABLE_WAIT_S = 0.05
"""Longest ``make_durable`` waits for the export lock (held by the worker while it writes a batch)
before giving up and leaving the record to the worker's next round."""
RING_DRAIN_AT = SLOTS // 2
"""Ring records not yet spooled at which ``emit_durable`` wakes the worker before its round ends:
every durable record is in the write-ahead ring *and* the queue until the worker spools it, and the
ring keeps only the last ``SLOTS``."""
RING_PERSIST_AT = SLOTS * 3 // 4
"""Ring records not yet spooled at which ``emit_durable`` spools the queue itself, in the caller: the
worker, woken at ``RING_DRAIN_AT``, has not kept up (a starved thread, a burst faster than it writes),
and a few more records would overwrite ring slots whose records are in neither the ring nor the
spool. A crash then loses nothing ``emit_durable`` called durable."""
STAMPED = -1
"""Queue items ``(STAMPED, record)`` were stamped by ``emit_durable`` (or ``emit`` for an urgent kind)
and copied into the ring: the worker must not re-stamp."""
TEMPLATED = -2
"""Queue items ``(TEMPLATED, (template, seq, time_ns, values))`` come from a durable ``emit_templated``
(also in the ring): the worker builds the record."""
TEMPLATED_QUEUED = -3
"""Like ``TEMPLATED`` from an ``emit_templated(..., durable=False)``: in the queue only."""
REQUIRED = {
    kind: frozenset(f.name for f in (*ENVELOPE, *fields) if f.required)
    for kind, fields in RECORD_KINDS.items()
}


class Agent:
    """One agent incarnation: a stream of records from this process to one exporter."""

    def __init__(self, config: Config, exporter: Exporter | None = None, *, forked: bool = False) -> None:
        self.config = config
        self.stream = uuid.uuid4().hex[:16]
        """New per incarnation (and so after every fork); part of each record's idempotency key."""
        self.forked = forked
        self.live = True
        self._rank = config.rank if config.rank is not None else 0
        self._job = config.job
        self._exporter: Any = exporter
        self.own_exporter = exporter is None
        """ddpscope's default (the spool and its shipper, made on first use), not an exporter of the caller's."""
        self._seqs = itertools.count()
        """``seq`` of each record; ``next`` is atomic under the GIL (the worker and ``emit_durable``
        callers both stamp)."""
        self._write_ahead: Any = None
        """The exporter's ``write_ahead(record) -> bool`` (the spool's mapped ring), once it exists."""
        self._write_ahead_templated: Any = None
        """Its ``write_ahead_templated(frame, seq, time_ns, values) -> bool``, for ``emit_templated``."""
        self._ring_queued = itertools.count(1)
        """``next`` numbers each record queued on the ring's path (``STAMPED``, ``TEMPLATED``), in queue
        order; atomic under the GIL like ``_seqs``."""
        self._ring_spooled = 0
        """How many of those the exporter has written, counted under the export lock. As the queue is
        first in, first out, the difference is the ring records a crash would find only in the ring."""
        self._persists = getattr(exporter, "crash_durable", True)
        """False for an exporter that keeps records in memory: writing to it early saves nothing from a
        crash, so ``emit_durable`` does not drain the queue in the caller for it."""
        self._direct = False
        """True once the spool could not be written and records go straight to the collector."""
        self._emitted = 0
        self._drops: collections.Counter[str] = collections.Counter()
        self._drops_lock = threading.Lock()
        self._checked: collections.Counter[Any] = collections.Counter()
        self._stats_sent: tuple[int, int] = (0, 0)
        self._stats_at = time.monotonic()
        self._worker = self._make_worker()
        self._queue = self._worker.queue
        self._max_queue = config.max_queue
        self._wake = self._worker.wake
        self._worker.start()

    def _make_worker(self) -> Any:
        from ddpscope.agent.worker import Worker

        return Worker(
            export=self._export_items,
            after_round=self._after_round,
            max_queue=self.config.max_queue,
            max_batch=self.config.max_batch,
            interval_s=self.config.flush_interval_s,
            on_start=self._get_exporter,
        )

    # -- hot path ------------------------------------------------------------------------------

    def emit(self, record: dict[str, Any]) -> None:
        """Queue one record; never blocks, never raises. Over the bound it drops and counts.

        The common path is one append (well under a microsecond): the worker stamps the record and
        writes it to the spool within a round (``BUSY_ROUND_S`` while records keep coming), so a
        SIGKILL can lose at most that last round of records emitted this way. Evidence cannot wait:
        urgent kinds (hang reports, errors) are stamped here and copied into the write-ahead ring,
        crash-durable when ``emit`` returns, and they wake the sender at once; collectives and their
        ends, step records and heartbeats use ``emit_durable`` or ``emit_templated``. Serialising every record
        here would cost 3-13 us per call instead."""
        try:
            if len(self._queue) < self._max_queue:  # 0 after shutdown
                kind = record.get("kind") if type(record) is dict else None
                if kind in URGENT_KINDS and self._write_ahead is not None:
                    if self._into_ring(record) is None:
                        return
                    next(self._ring_queued)  # counted like emit_durable's; the wake below drains it
                else:
                    self._queue.append((now_ns(), record))
                if kind in URGENT_KINDS:
                    self._wake()
                elif self._worker.idle:
                    self._worker.nudge()
            else:
                self._drop("queue_full" if self.live else "after_shutdown", record)
        except Exception:
            swallowed("emit")

    def make_durable(self, timeout_s: float = DURABLE_WAIT_S) -> bool:
        """Write every record emitted so far to the exporter (the on-disk spool) before returning:
        called right after emitting a record that may be the last before this process is aborted (a
        collective library aborts ~1 ms after the call, well inside the worker's 20 ms round). Costs
        one spool append (~10-20 us, see bench/agent.py) and nothing when the queue is empty; waits
        at most ``timeout_s`` for the export lock, then leaves the records to the worker. Never
        raises; True once everything is written."""
        try:
            if self._exporter is None:
                # Made by the worker as it starts; made here when this comes first. It must exist before
                # the test below: an unwritable spool gives an exporter that posts, and a post to an
                # unreachable collector would hold the training thread for its export timeout.
                self._worker.locked(self._get_exporter, timeout_s)
            if self._exporter is None:
                return False  # the worker is still making it: the record waits for its round
            if self._direct:
                return True  # nothing gets more durable by being sent from this thread: the worker sends it
            return bool(self._worker.persist(timeout_s))
        except Exception:
            swallowed("make_durable")
            return False

    def emit_durable(self, record: dict[str, Any]) -> bool:
        """``emit`` a record that must survive an abort right after this call (the collective
        recorder's, before the collective enters torch). Stamped here, in the caller, and copied into
        the exporter's write-ahead ring (a memory-mapped file, ~3 us warm, no system call and no
        wake-up); the stamped record then takes the ordinary path to the spool, with the same
        idempotency key. Without a ring (another exporter, a record too big for a slot) it falls back
        to ``emit`` and ``make_durable``, except for an exporter that keeps records in memory, which
        a crash takes anyway. Never raises; True once the record is crash-durable (or as durable as
        the exporter makes anything)."""
        try:
            if self._write_ahead is None or len(self._queue) >= self._max_queue:
                self.emit(record)
                return self.make_durable() if self._persists else True
            durable = self._into_ring(record)
            if durable is None:
                return False
            return self._after_ring(durable)
        except Exception:
            swallowed("emit_durable")
            return False

    def emit_templated(self, template: RecordTemplate, values: tuple[int, ...], durable: bool = True) -> bool:
        """Emit the record ``template`` makes with ``values`` (see ``template.py``): for the recorder's
        bucket all-reduces, where building and marshalling a dict in the caller costs 3-4x more. The
        same record as ``emit_durable(template.expand(values))`` (or ``emit`` when not ``durable``)
        would send; the worker builds it. Never raises; True once it is crash-durable.

        Written for the fewest operations on the common path: with the caches cold from a backward
        pass, each costs about half a microsecond."""
        try:
            queue = self._queue
            put = self._write_ahead_templated
            if len(queue) >= self._max_queue or len(values) != template.width:
                return self._emit_expanded(template, values, durable)
            index = template.time_index
            t = now_ns() if index is None else values[index]
            s = next(self._seqs)
            worker = self._worker
            if not durable or put is None:
                # No ring: an exporter that keeps records in memory (a crash takes them anyway:
                # emit_durable says True for it too), or the worker has not made the spool's yet, and
                # the record is written to the spool now, as emit_durable does. Either way the worker
                # builds it, with the records it implies (a step record's bucket ends: agent/implied.py).
                queue.append((TEMPLATED_QUEUED, (template, s, t, values)))
                if durable and self._persists:
                    return self.make_durable()
                if worker.idle:
                    worker.nudge()
                return put is None
            encoded = template.encoded
            if encoded is None or encoded[0] is not self.stream:
                encoded = template.encoded = (self.stream, self._encode(template))
            ok = encoded[1] is not None and put(encoded[1], s, t, values)
            queue.append((TEMPLATED, (template, s, t, values)))
            return self._after_ring(ok)
        except Exception:
            swallowed("emit_templated")
            return False

    def _after_ring(self, in_ring: bool) -> bool:
        """After a record went into the ring (if ``in_ring``) and the queue: keep the ring from
        overwriting a record the spool does not have yet. Returns whether the record is durable."""
        unspooled = next(self._ring_queued) - self._ring_spooled
        worker = self._worker
        if unspooled >= RING_DRAIN_AT:
            # Fast steps with many buckets: drain now rather than at the round's end, and if the worker
            # has fallen this far behind, in this thread (RING_PERSIST_AT).
            if unspooled >= RING_PERSIST_AT:
                return bool(worker.persist(DURABLE_WAIT_S)) or in_ring
            worker.nudge()
        elif worker.idle:
            worker.nudge()
        return in_ring or bool(worker.persist(DURABLE_WAIT_S))

    def _emit_expanded(self, template: RecordTemplate, values: tuple[int, ...], durable: bool) -> bool:
        """``emit_templated`` the ordinary way, which drops and counts it: a full queue or the wrong
        number of values."""
        if len(values) != template.width:
            self._drop("invalid", template.fixed)
            swallowed(f"emit_templated: {len(values)} values for {template.variables}")
            return False
        record = template.expand(values)
        if template.time_index is not None:
            record["time_ns"] = values[template.time_index]
        if durable:
            return self.emit_durable(record)
        self.emit(record)
        return False

    def _encode(self, template: RecordTemplate) -> Any:
        fixed = {"rank": self._rank, **template.fixed, "job": self._job, "stream": self.stream}
        if template.implies is not None:
            fixed[IMPLIES_KEY] = template.implies  # for the shipper's replay of the ring
        return encode_template(fixed, template.variables)

    def _build(self, template: RecordTemplate, s: int, t: int, values: tuple[int, ...]) -> dict[str, Any]:
        # The record read back from the ring is the same dict (ring.read_ring), key for key.
        return {
            "rank": self._rank,
            **template.fixed,
            **fill(template.variables, values),
            "job": self._job,
            "stream": self.stream,
            "seq": s,
            "time_ns": t,
        }

    def _into_ring(self, record: dict[str, Any]) -> bool | None:
        """Stamp ``record`` here, copy it into the write-ahead ring and queue the stamped copy for the
        spool (same idempotency key). None when it is not a valid record (dropped and counted), else
        whether the ring took it (a record too big for a slot waits for the worker)."""
        out = self._stamp(now_ns(), record)
        if out is None:
            return None
        durable = bool(self._write_ahead(out))
        self._queue.append((STAMPED, out))
        return durable

    def _drop(self, reason: str, record: Any) -> None:
        kind = record.get("kind") if isinstance(record, dict) else None
        with self._drops_lock:
            self._drops[f"{reason}:{kind}"] += 1

    # -- worker thread (under the worker's export lock) ----------------------------------------

    def _get_exporter(self) -> Any:
        if self._exporter is None:
            from ddpscope.agent.spool_exporter import SpoolExporter

            cfg = self.config
            rank = "x" if cfg.rank is None else str(cfg.rank)
            try:
                self._exporter = SpoolExporter(
                    spool_dir=cfg.spool_dir,
                    prefix=f"r{rank}-{self.stream}",
                    meta={"job": cfg.job, "rank": self._rank, "stream": self.stream},
                    ingest_url=cfg.ingest_url,
                    token=cfg.token,
                    spool_max_bytes=cfg.spool_max_bytes,
                    http_timeout_s=cfg.http_timeout_s,
                    retry_max_backoff_s=cfg.retry_max_backoff_s,
                    linger_s=cfg.shipper_linger_s,
                )
            except OSError as e:
                self._exporter = self._direct_exporter(e)
                # Nothing to make durable: emit_durable must not wait for a POST on the training thread.
                self._persists = False
        if self._write_ahead is None:
            self._write_ahead = getattr(self._exporter, "write_ahead", None)
            self._write_ahead_templated = getattr(self._exporter, "write_ahead_templated", None)
        return self._exporter

    def _direct_exporter(self, error: OSError) -> Any:
        """The spool cannot be written (a directory that is not writable, a full disk): records go straight
        to the collector from the worker thread instead, said once. They lose their crash durability
        (what is not yet sent when the process dies is lost) but still arrive."""
        from ddpscope.agent.transport import HttpExporter

        cfg = self.config
        logger.warning(
            "ddpscope: cannot use the spool directory %s (%s); sending records straight to the collector at %s "
            "instead, without the spool's crash durability (records not yet sent when this process dies are "
            "lost). Point DDPSCOPE_SPOOL_DIR at a writable directory with free space.",
            cfg.spool_dir,
            error,
            cfg.ingest_url,
        )
        self._direct = True
        return HttpExporter(
            cfg.ingest_url,
            token=cfg.token,
            timeout_s=cfg.http_timeout_s,
            retry_max_backoff_s=cfg.retry_max_backoff_s,
            # One request's wait, not the spool shipper's 30 s: a flush at exit posts in the exiting thread.
            export_timeout_s=cfg.http_timeout_s,
        )

    def _say_lost(self) -> None:
        """With no spool, what never reached the collector is gone with this process: say so as it ends
        (with a spool, the shipper says where the records wait instead)."""
        lost = sum(getattr(self._exporter, "dropped", {}).values())
        if lost:
            logger.warning(
                "ddpscope: %d records of this rank never reached the collector at %s and, with no spool to "
                "keep them, are lost",
                lost,
                self.config.ingest_url,
            )

    def _export_items(self, items: list[tuple[int, Any]]) -> None:
        batch = []
        ringed = 0
        for t, record in items:
            self._emitted += 1
            if t < 0:
                ringed += t != TEMPLATED_QUEUED
                if t != STAMPED:
                    built = self._build(*record)  # checked once, when the template was made
                    batch.append(built)
                    if record[0].implies is not None:
                        batch.extend(self._implied(record[0].implies, built))
                    continue
            out = record if t == STAMPED else self._stamp(t, record)
            if out is not None:
                batch.append(out)
        try:
            if batch:
                self._send(batch)
        finally:
            self._ring_spooled += ringed  # written or lost: either way no longer waiting behind the ring

    def _implied(self, implies: Implies, built: dict[str, Any]) -> list[dict[str, Any]]:
        """The records ``built`` implies (``agent/implied.py``), envelope and all, checked like any."""
        try:
            out = implied_records(implies, built)
            if self.config.validate:
                for r in out:
                    self._check(r)
            return out
        except Exception:
            swallowed("implied records")
            return []

    def _stamp(self, t: int, record: Any) -> dict[str, Any] | None:
        try:
            # One dict display: rank and time_ns are defaults the record may override, the rest of the
            # envelope is ours. (Half the cost of a copy and five stores with the caches cold, as they
            # are when the recorder calls this between a backward hook and an all-reduce.) The seq is
            # taken before the check: an invalid record leaves a gap in seq, which nothing relies on.
            out = {
                "rank": self._rank,
                "time_ns": t,
                **record,
                "job": self._job,
                "stream": self.stream,
                "seq": next(self._seqs),
            }
        except (TypeError, ValueError, RuntimeError):
            self._drop("invalid", record)
            swallowed("emit: not a record")
            return None
        if self.config.validate:
            try:
                self._check(out)
            except RecordError:
                self._drop("invalid", out)
                swallowed(f"emit: invalid {out.get('kind')!r} record")
                return None
        if out["kind"] in URGENT_KINDS:
            _print_urgent(out)
        return out

    def _check(self, record: dict[str, Any]) -> None:
        """Full wire-format check of the first records of each kind and then of one in 64; the rest
        get the cheap check that every required field is present (a full check of a 50-bucket step
        record costs ~50 us of worker time, the cheap one ~1 us)."""
        kind = record.get("kind")
        n = self._checked[kind]
        self._checked[kind] = n + 1
        if n < FULL_CHECKS or n % 64 == 0 or kind not in REQUIRED:
            validate_record(record)
        elif not REQUIRED[kind] <= record.keys():
            missing = sorted(REQUIRED[kind] - record.keys())
            raise RecordError(f"record.{missing[0]}: required field is missing")

    def _send(self, batch: list[dict[str, Any]]) -> None:
        exporter = self._get_exporter()
        result = exporter.export(batch)
        # An exporter with its own `dropped` counter accounts for what it did not deliver.
        if result is not ExportResult.SUCCESS and not hasattr(exporter, "dropped"):
            reason = "rejected" if result is ExportResult.FAILURE else "export_failed"
            for record in batch:
                self._drop(reason, record)

    def stats(self) -> dict[str, Any]:
        """Cumulative counts since this stream started, as shipped in ``agent_stats``."""
        with self._drops_lock:
            dropped = collections.Counter(self._drops)
        exporter_drops = getattr(self._exporter, "dropped", None)
        if exporter_drops:
            dropped.update(exporter_drops)
        queue_drops = sum(n for k, n in dropped.items() if k.startswith(("queue_full:", "after_shutdown:")))
        spool_bytes = getattr(self._exporter, "spool_bytes", None)
        return {
            "emitted": self._emitted + queue_drops,
            "dropped": dict(dropped),
            "spool_bytes": spool_bytes() if callable(spool_bytes) else 0,
        }

    def _after_round(self, final: bool) -> None:
        # Most rounds end here: the worker wakes 50 times a second and must cost nearly nothing.
        if not final and time.monotonic() - self._stats_at < self.config.stats_interval_s:
            return
        stats = self.stats()
        key = (stats["emitted"], sum(stats["dropped"].values()))
        if key == self._stats_sent:
            return
        self._stats_sent = key
        self._stats_at = time.monotonic()
        record = self._stamp(now_ns(), {"kind": "agent_stats", **stats})
        if record is not None:
            self._send([record])

    # -- control -------------------------------------------------------------------------------

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export everything emitted so far and wait until the exporter has delivered it."""
        deadline = time.monotonic() + timeout_s
        try:
            if not self._worker.flush(timeout_s):
                return False
            exporter = self._get_exporter()
            return bool(exporter.force_flush(max(0.0, deadline - time.monotonic())))
        except Exception:
            swallowed("force_flush")
            return False

    def flush_local(self, timeout_s: float = 5.0) -> bool:
        """Hand everything emitted so far to the exporter (the on-disk spool by default) without
        waiting for the collector: once True, those records survive a SIGKILL or abort of this
        process. The worker does this by itself every ``flush_interval_s``. False at once when there is no
        spool to write (``_direct_exporter``): handing records over would mean posting them from here."""
        try:
            if self._direct:
                self._wake()
                return False
            return self._worker.flush(timeout_s)
        except Exception:
            swallowed("flush_local")
            return False

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Drain and stop within ``timeout_s``; later emits are dropped (and counted)."""
        if not self.live:
            return
        deadline = time.monotonic() + timeout_s
        try:
            self._max_queue = 0  # from now on emit() counts instead of queueing
            drained = self._worker.shutdown(timeout_s)
            self.live = False
            if drained and self._write_ahead is not None:
                # Everything is in the spool: the ring's copies would only be resent.
                self._get_exporter().drop_write_ahead()
            self._get_exporter().shutdown(max(0.0, deadline - time.monotonic()))
            if self._direct:
                self._say_lost()
        except Exception:
            swallowed("shutdown")
        finally:
            self.live = False

    @property
    def exporter(self) -> Any:
        return self._exporter


class NullAgent:
    """``DDPSCOPE_DISABLED=1``: no thread, no file, no hook; every call is a no-op."""

    forked = False
    live = False
    stream = ""

    def __init__(self, config: Config) -> None:
        self.config = config

    def emit(self, record: dict[str, Any]) -> None:
        return None

    def make_durable(self, timeout_s: float = DURABLE_WAIT_S) -> bool:
        return True

    def emit_durable(self, record: dict[str, Any]) -> bool:
        return True

    def emit_templated(self, template: RecordTemplate, values: tuple[int, ...], durable: bool = True) -> bool:
        return True

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def flush_local(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"emitted": 0, "dropped": {}, "spool_bytes": 0}


_last_printed: list[str] = [""]
"""The last line ``_print_urgent`` wrote: an error reported when raised and again as it ends the process
is one line on stderr (both records still go to the collector)."""


def _print_urgent(record: dict[str, Any]) -> None:
    text = str(record.get("message") or record.get("error_type") or "").splitlines()
    line = f"ddpscope: {record['kind']} rank={record.get('rank')} step={record.get('step')}"
    key = f"{line}: {text[:1]}"
    if key == _last_printed[0]:
        return
    _last_printed[0] = key
    try:
        sys.stderr.write(f"{line}: {text[0][:300]}\n" if text else f"{line}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        return  # stderr closed or replaced: the record still goes to the collector


_agent: Agent | NullAgent | None = None
_lock = threading.Lock()
_fork_parent: Agent | None = None
"""In a forked child: the parent's agent, whose config the child's own agent reuses."""


def _build(config: Config, exporter: Any, forked: bool = False) -> Agent | NullAgent:
    if config.disabled:
        return NullAgent(config)
    lifecycle.install(lambda: _agent, _after_fork_child)
    return Agent(config, exporter, forked=forked)


def _after_fork_child() -> None:
    global _agent, _lock, _fork_parent
    # The parent's lock and thread are not ours; never touch them in the child.
    _lock = threading.Lock()
    if isinstance(_agent, Agent):
        _fork_parent = _agent
    _agent = None


def get_agent() -> Agent | NullAgent:
    """The process's agent, created from the environment on first use."""
    global _agent
    agent = _agent
    if agent is not None:
        return agent
    with _lock:
        if _agent is None:
            parent = _fork_parent
            if parent is None:
                _agent = _build(Config.from_env(), None)
            elif parent._exporter is None or type(parent._exporter).__name__ == "SpoolExporter":
                _agent = _build(parent.config, None, forked=True)
                lifecycle.register_child_exit(_agent)
            else:
                # A custom exporter object cannot follow us into a child process.
                _agent = NullAgent(parent.config)
        return _agent


def configure(**overrides: Any) -> Agent | NullAgent:
    """(Re)create the agent: explicit settings > ``DDPSCOPE_*`` env > defaults (see ``Config``).

    ``exporter=`` takes an exporter object (``InMemoryExporter()``, ``HttpExporter(...)``); by default
    records go to the disk spool and a shipper process. Raises ``ValueError`` naming a bad setting.
    The previous agent, if any, is flushed and shut down.
    """
    global _agent
    exporter = overrides.pop("exporter", None)
    config = Config.from_env(None, **overrides)
    with _lock:
        old, _agent = _agent, _build(config, exporter)
        new = _agent
    if old is not None:
        old.shutdown(lifecycle.EXIT_FLUSH_S)
    if not config.disabled:
        lifecycle.install_sigterm()
    return new


def adopt_rank(rank: int | None = None) -> None:
    """Give the process group's rank (``rank``, else the default group's, if one exists) to an agent
    configured without one, which labels its records rank 0.

    No ``RANK`` in the environment is how ``torch.multiprocessing.spawn`` and a script that passes ``rank=``
    to ``init_process_group`` run: without this every rank's heartbeats, collectives and hang reports said
    rank 0. The agent is rebuilt with the rank, as ``configure`` would (the old one flushes what it holds).
    An agent given a rank, disabled, or writing to an exporter of the script's own is left as it is.
    Never raises."""
    global _agent
    try:
        rank = group_rank() if rank is None else rank
        if rank is None:
            return
        old = None
        with _lock:
            current = _agent
            if current is None:
                _agent = _build(Config.from_env(None, rank=rank), None)
            elif isinstance(current, Agent) and current.config.rank is None and current.own_exporter:
                old, _agent = current, _build(dataclasses.replace(current.config, rank=rank), None)
        if old is not None:
            old.shutdown(lifecycle.EXIT_FLUSH_S)
    except Exception:
        swallowed("adopt_rank")


def emit(record: dict[str, Any]) -> None:
    """Hand one record to the agent; never blocks and never raises (see ``Agent.emit``)."""
    agent = _agent
    if agent is None:
        try:
            agent = get_agent()
        except Exception:
            swallowed("emit: creating the agent")
            return
    agent.emit(record)


def make_durable(timeout_s: float = DURABLE_WAIT_S) -> bool:
    """Write everything emitted so far to the spool before returning, so it survives an abort or a
    SIGKILL right after (see ``Agent.make_durable``); never raises."""
    agent = _agent
    if agent is None:
        return True  # nothing was ever emitted in this process
    return agent.make_durable(timeout_s)


def emit_durable(record: dict[str, Any]) -> bool:
    """``emit`` a record that must survive an abort or SIGKILL right after this call (cheaply, through
    the spool's write-ahead ring; see ``Agent.emit_durable``); never raises."""
    agent = _agent
    if agent is None:
        try:
            agent = get_agent()
        except Exception:
            swallowed("emit_durable: creating the agent")
            return False
    return agent.emit_durable(record)


def emit_templated(template: RecordTemplate, values: tuple[int, ...], durable: bool = True) -> bool:
    """Emit the record ``template`` makes with ``values``: crash-durable like ``emit_durable`` at a
    fraction of its cost in the caller (see ``Agent.emit_templated``); never raises."""
    agent = _agent
    if agent is None:
        try:
            agent = get_agent()
        except Exception:
            swallowed("emit_templated: creating the agent")
            return False
    return agent.emit_templated(template, values, durable)


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush and stop the process's agent within ``timeout_s``."""
    agent = _agent
    if agent is not None:
        agent.shutdown(timeout_s)
