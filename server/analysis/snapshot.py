"""One job's state as plain data: what job status, incidents and /metrics reason about.

``load_snapshot(storage, job)`` reads everything from storage in a handful of queries and returns a
``JobSnapshot``; the analysis functions (``status.job_status(snapshot, now_s)``,
``incidents.diagnose(snapshot, now_s)``) are pure functions of it, so tests build snapshots by hand or
from synthetic wire records (``snapshot_from_records``) without a database.

Every record inside is a **wire-shaped dict**: exactly the fields of ``ddpscope.agent.records``
(envelope ``kind, job, rank, stream, seq, time_ns`` plus the kind's fields). Shapes:

- ``ranks``: ``{rank: rank_start}``, the latest ``rank_start`` of each rank (``world_size``,
  ``find_unused_parameters``, ``host``, ``pid``, ``clock_error_ns``, ...).
- ``layouts``: every ``layout`` record, oldest first (rank 0's first, then others; all ranks send one).
- ``heartbeats``: ``{rank: heartbeat}``, the latest heartbeat of each rank (``phase``, ``step``,
  ``last_coll_seq``, ``pid``, ``time_ns``).
- ``hangs``, ``hang_resolved``, ``rank_errors``, ``rank_exits``, ``warnings``, ``digests``
  (``replica_digest``): every record of that kind, ordered by ``time_ns``.
- ``memory``: the ``memory`` records of the last ``MEMORY_WINDOW_NS`` before the newest one, ordered by
  ``time_ns`` (a rank sends one every 30 s: a long job's whole history would be read for nothing).
- ``collectives``: ``collective`` records with their ``collective_end`` merged in as three extra keys,
  ``end_ns`` (int or None while in flight), ``ok`` (bool or None), ``error`` (str or None). Only a recent
  window is loaded: per process group, the collectives whose ``coll_seq`` is within
  ``COLLECTIVE_WINDOW`` of the highest sequence number any rank issued on it (ranks move in lockstep
  on a group, so a hang or a mismatch is always inside it). Sorted by ``(pg, coll_seq, rank)``.
- ``steps``: ``{rank: RankSteps}``: count of step records, the step the rank completed last and its
  ``backward_end_ns`` (after a restart, the new process's step, even when an earlier attempt got
  further).
- ``unused``: ``[UnusedParameter]``: parameters that got no gradient, aggregated by name over ranks
  and steps (see ``analysis.unused``).
- ``agent_stats``: ``{rank: agent_stats}``: the latest agent accounting of each rank (cumulative per
  stream; ``dropped`` maps ``'reason:kind'`` to a count).
- ``rank_last_seen_s``: ``{rank: seconds}``: aligned-clock time of the newest record of each rank,
  any kind but its shipper's (which outlives the rank: ``note_seen``); ``last_seen_s`` is the maximum over
  ranks (0.0 for a job with no records).

``world_size`` is the newest ``rank_start``'s value (a relaunch under the same job id may have fewer
ranks: ``retired_ranks``), else 1 + the highest rank seen.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ddpscope.agent.records import is_shipper_stream

if TYPE_CHECKING:
    from ddpscope.server.storage import Storage

COLLECTIVE_WINDOW = 256
"""Collectives kept per process group in a snapshot: enough to match ranks around a hang or a
mismatch without loading a long job's whole history."""

Record = dict[str, Any]
R = TypeVar("R", bound=Mapping[str, Any])


@dataclass(slots=True)
class RankSteps:
    """Step progress of one rank."""

    rank: int
    count: int
    """Number of step records stored for the rank."""
    last_step: int
    last_step_end_ns: int
    """``backward_end_ns`` of the last step: when the rank last completed an iteration."""


@dataclass(slots=True)
class UnusedParameter:
    """A parameter that got no gradient on some rank in some step."""

    name: str
    ranks: list[int]
    """Ranks on which it was unused at least once, ascending."""
    steps: int
    """Number of steps in which it was unused on at least one rank."""
    first_step: int | None = None
    """The first and last step in which it was unused (on any rank)."""
    last_step: int | None = None


@dataclass(slots=True)
class JobSnapshot:
    """Everything known about one job (see the module docstring for each field's shape)."""

    job: str
    world_size: int
    ranks: dict[int, Record] = field(default_factory=dict)
    layouts: list[Record] = field(default_factory=list)
    heartbeats: dict[int, Record] = field(default_factory=dict)
    hangs: list[Record] = field(default_factory=list)
    hang_resolved: list[Record] = field(default_factory=list)
    rank_errors: list[Record] = field(default_factory=list)
    rank_exits: list[Record] = field(default_factory=list)
    warnings: list[Record] = field(default_factory=list)
    digests: list[Record] = field(default_factory=list)
    memory: list[Record] = field(default_factory=list)
    collectives: list[Record] = field(default_factory=list)
    steps: dict[int, RankSteps] = field(default_factory=dict)
    unused: list[UnusedParameter] = field(default_factory=list)
    agent_stats: dict[int, Record] = field(default_factory=dict)
    rank_last_seen_s: dict[int, float] = field(default_factory=dict)
    listening_since_s: float | None = None
    """When the collector that loaded this started (``Storage.opened_s``); None in pure analysis."""
    starts: list[Record] = field(default_factory=list)
    """Every ``rank_start`` of every process of every rank, oldest first (``ranks`` keeps each rank's
    latest)."""
    stream_seen_ns: dict[tuple[int, str], int] = field(default_factory=dict)
    """``{(rank, stream): time_ns}`` of each agent stream's latest ``agent_stats`` (a live agent sends one
    every few seconds): how long each process of a rank kept reporting."""
    stall_samples: list[Record] = field(default_factory=list)
    """The newest ``STALL_SAMPLES`` ``stall_sample`` records, oldest first: where a rank was in a stall of its
    own when a peer gave up on it (``stalled_culprits.py``)."""
    retired: dict[int, int] = field(default_factory=dict)
    """Ranks the newest launch left out (``retired_ranks``), with that launch's start (ns): not in
    ``ranks``, ``steps``, ``agent_stats`` or ``rank_last_seen_s``; ``split_restart`` puts what they
    sent before the launch with the earlier processes."""

    @property
    def last_seen_s(self) -> float:
        return max(self.rank_last_seen_s.values(), default=0.0)

    @property
    def find_unused_parameters(self) -> bool:
        """True when any rank's engine runs with ``find_unused_parameters=True``."""
        return any(bool(r.get("find_unused_parameters")) for r in self.ranks.values())


_P2P_PAIR = re.compile(r":p2p:(\d+)-(\d+)$")


def p2p_pair(pg: str) -> tuple[int, int] | None:
    """The two global ranks of a point-to-point channel ``<group>:p2p:<a>-<b>`` (a user's send/recv,
    ddpscope's clock sync), None for any other group (or a recv from any source)."""
    m = _P2P_PAIR.search(pg)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def named_ranks(collectives: Iterable[Mapping[str, Any]]) -> set[int]:
    """Every rank the collectives name as a member of a group or a point-to-point pair: a rank that
    never reported anything is still known to exist (its peers wait for it)."""
    out: set[int] = set()
    for pg in {c["pg"] for c in collectives}:
        pair = p2p_pair(pg)
        if pair is not None:
            out.update(pair)
    for members in {tuple(c["group_ranks"]) for c in collectives if c.get("group_ranks")}:
        out.update(members)
    return out


def merge_collectives(
    collectives: Iterable[Mapping[str, Any]], ends: Iterable[Mapping[str, Any]]
) -> list[Record]:
    """Attach each ``collective_end`` to its ``collective`` (same job, rank, stream, pg, coll_seq: a
    restarted rank numbers its collectives from 1 again)."""
    by_key = {(e["rank"], e["stream"], e["pg"], e["coll_seq"]): e for e in ends}
    merged = []
    for c in collectives:
        out = dict(c)
        end = by_key.get((c["rank"], c["stream"], c["pg"], c["coll_seq"]))
        out["end_ns"] = end["end_ns"] if end else None
        out["ok"] = end["ok"] if end else None
        out["error"] = end.get("error") if end else None
        merged.append(out)
    merged.sort(key=lambda r: (r["pg"], r["coll_seq"], r["rank"]))
    return merged


PER_PROCESS = (
    "layouts",
    "hangs",
    "hang_resolved",
    "rank_errors",
    "rank_exits",
    "warnings",
    "digests",
    "memory",
    "collectives",
)
"""The record lists of a snapshot that belong to one process of a rank (``split_restart`` divides them)."""


def split_restart(snapshot: JobSnapshot) -> tuple[JobSnapshot, JobSnapshot | None]:
    """``(current, previous)``: the job as its current processes see it, and what the processes
    before a restart left (None when no rank restarted, or the earlier processes left no error, hang
    report or collective to diagnose).

    A rank restarted when its latest ``rank_start`` comes from a new agent incarnation (stream); the
    records of other streams that are older than that start belong to the earlier process. (The new
    process's own records before its ``rank_start``, such as the engine's construction collectives,
    share its stream; a reconfigured agent's new stream starts after it.) Everything a rank the newest
    launch left out (``JobSnapshot.retired``) sent before that launch belongs to the earlier run.
    ``previous`` has no ``ranks``, so every record in it counts, and its ``rank_last_seen_s`` is rebuilt
    from its records.
    """
    starts = process_starts(snapshot)

    def earlier(rec: Mapping[str, Any]) -> bool:
        return _before_start(rec, starts.get(rec["rank"]))

    older = _select(snapshot, earlier)
    if not any(older.values()):
        return snapshot, None
    current = replace(snapshot, **_select(snapshot, lambda rec: not earlier(rec)))
    unstarted = [r for r, (stream, _) in starts.items() if stream is not None and r in snapshot.ranks
                 and snapshot.ranks[r]["stream"] != stream]  # fmt: skip
    if unstarted:
        # Relaunched processes that never reached their DDP model: the old ones' start, steps and
        # accounting are not theirs.
        current.ranks = {r: s for r, s in current.ranks.items() if r not in unstarted}
        current.steps = {r: s for r, s in current.steps.items() if r not in unstarted}
        current.agent_stats = {r: a for r, a in current.agent_stats.items() if r not in unstarted}
    if not (older["rank_errors"] or older["hangs"] or older["collectives"]):
        return current, None
    return current, _history(snapshot, older)


def without_processes(snapshot: JobSnapshot, processes: Container[tuple[int, str]]) -> JobSnapshot:
    """``snapshot`` without the records of ``processes`` (``(rank, stream)``; a process's derived streams go with
    it): a second process of a rank (``shared_job.twin_processes``) left out of the other diagnoses."""

    def keep(rec: Mapping[str, Any]) -> bool:
        return (rec["rank"], process_stream(str(rec.get("stream")))) not in processes

    starts = [s for s in snapshot.starts if keep(s)]
    ranks = dict(snapshot.ranks)
    for r, start in snapshot.ranks.items():
        if not keep(start):
            theirs = [s for s in starts if s["rank"] == r]
            if theirs:
                ranks[r] = theirs[-1]
            else:
                del ranks[r]
    seen = {
        key: ns for key, ns in snapshot.stream_seen_ns.items() if keep({"rank": key[0], "stream": key[1]})
    }
    return replace(snapshot, **_select(snapshot, keep), starts=starts, ranks=ranks, stream_seen_ns=seen)


def _process_records(snapshot: JobSnapshot) -> list[Record]:
    """Every record of ``snapshot`` that belongs to one process of a rank: ``PER_PROCESS``'s and heartbeats."""
    return [*snapshot.heartbeats.values(), *(r for f in PER_PROCESS for r in getattr(snapshot, f))]


def _select(snapshot: JobSnapshot, keep: Callable[[Record], bool]) -> dict[str, Any]:
    """The per-process fields of ``snapshot`` (``PER_PROCESS`` and heartbeats) with only the records ``keep``
    takes, as JobSnapshot keyword arguments."""
    out: dict[str, Any] = {f: [r for r in getattr(snapshot, f) if keep(r)] for f in PER_PROCESS}
    out["heartbeats"] = {rank: h for rank, h in snapshot.heartbeats.items() if keep(h)}
    return out


def _first_heard(snapshot: JobSnapshot, ranks: Container[int] | None = None) -> dict[int, dict[str, int]]:
    """``{rank: {process: time_ns}}``: when each process of each rank (of ``ranks``, default all) sent its
    first per-process record. A process's derived streams (``<stream>.crash``, ``<stream>.shipper-<pid>``)
    are that process."""
    out: dict[int, dict[str, int]] = {}
    for rec in _process_records(snapshot):
        rank, stream = rec["rank"], rec.get("stream")
        if stream is not None and (ranks is None or rank in ranks):
            mine = out.setdefault(rank, {})
            process = process_stream(str(stream))
            mine[process] = min(mine.get(process, rec["time_ns"]), rec["time_ns"])
    return out


def _history(snapshot: JobSnapshot, fields: Mapping[str, Any]) -> JobSnapshot:
    """A snapshot of processes that ran before a restart, from their ``PER_PROCESS`` records and heartbeats:
    no ``ranks`` (every record counts), ``rank_last_seen_s`` from the records."""
    history = JobSnapshot(job=snapshot.job, world_size=snapshot.world_size, **fields)
    note_seen(history.rank_last_seen_s, _process_records(history))
    return history


def note_seen(seen: dict[int, float], records: Iterable[Mapping[str, Any]]) -> None:
    """Raise ``seen`` (``rank_last_seen_s``) to the newest of ``records`` per rank, leaving out a shipper's:
    it outlives its rank to send what the rank left, so its records' times say nothing of the rank being
    alive (the collector's writer counts them alike)."""
    for rec in records:
        if not is_shipper_stream(rec["stream"]):
            seen[rec["rank"]] = max(seen.get(rec["rank"], 0.0), rec["time_ns"] / 1e9)


def split_attempts(previous: JobSnapshot) -> list[JobSnapshot]:
    """``split_restart``'s ``previous`` (everything before the current processes) as one snapshot per
    attempt, oldest first: a job torchrun restarted twice before the current attempt ran three times, and
    each attempt ended in its own way (a hang, then a restart that failed to connect). Each rank's
    processes are taken in the order they began (a process's derived streams are that process), and its
    k-th process belongs to attempt k: torchrun restarts every rank together."""
    began = _first_heard(previous)
    attempt = {
        (rank, process): k
        for rank, mine in began.items()
        for k, process in enumerate(sorted(mine, key=lambda p: (mine[p], p)))
    }
    count = max(attempt.values(), default=0) + 1
    if count == 1:
        return [previous]

    def of(k: int) -> Callable[[Record], bool]:
        """Whether a record is attempt ``k``'s."""
        return lambda rec: attempt[(rec["rank"], process_stream(str(rec.get("stream"))))] == k

    return [_history(previous, _select(previous, of(k))) for k in range(count)]


def process_starts(snapshot: JobSnapshot) -> dict[int, tuple[str | None, int]]:
    """``{rank: (stream, time_ns)}``: where each rank's current process begins. Its latest ``rank_start``;
    for a rank the newest launch left out, ``(None, that launch's start)``; and for a rank whose process
    exited and whose next process reported without reaching a ``rank_start`` (a torchrun restart that
    failed in ``init_process_group``), that process's stream and first record."""
    starts: dict[int, tuple[str | None, int]] = {
        r: (s["stream"], s["time_ns"]) for r, s in snapshot.ranks.items()
    }
    starts.update({r: (None, launch_ns) for r, launch_ns in snapshot.retired.items()})
    starts.update(_relaunched_unstarted(snapshot, starts))
    return starts


def current_process_reports(job: str, reports: Iterable[Record]) -> list[Record]:
    """Of ``reports`` (a job's ``rank_start`` records and per-process records, oldest first), the
    per-process records of each rank's current process (``process_starts``), in their order: a relaunch
    that failed in its set-up, before any ``rank_start`` of its own, is current, and the process before it
    is not; a crash report the shipper sent for the current process (a derived stream) is current."""
    reports = list(reports)
    starts = process_starts(snapshot_from_records(job, reports))
    return [r for r in reports if r["kind"] != "rank_start" and not _before_start(r, starts.get(r["rank"]))]


def _relaunched_unstarted(
    snapshot: JobSnapshot, starts: Mapping[int, tuple[str | None, int]]
) -> dict[int, tuple[str, int]]:
    """Ranks with a process that began after another process of the rank had exited (``rank_exit``), and
    later than the rank's latest ``rank_start``, whose own process must be one that exited: a restart that
    never reached its DDP model (a torchrun restart failing in ``init_process_group``, a job rerun under
    the same id that fails in its set-up again). ``{rank: (that process's stream, its first record's
    time)}``, the newest such process. A process's derived streams (``<stream>.crash``,
    ``<stream>.shipper-<pid>``) are that process."""
    if not snapshot.rank_exits:
        return {}  # the usual case, asked at every diagnosis: no process has exited, none came after one
    exits: dict[int, dict[str, int]] = {}
    """rank -> process -> when it exited."""
    for e in snapshot.rank_exits:
        own = exits.setdefault(e["rank"], {})
        process = process_stream(str(e["stream"]))
        own[process] = max(own.get(process, 0), e["time_ns"])
    firsts = _first_heard(snapshot, exits)
    out: dict[int, tuple[str, int]] = {}
    for rank, seen in firsts.items():
        start = starts.get(rank)
        if start is not None and start[0] is None:
            continue  # left out by the newest launch: its records are the earlier run's
        started = None if start is None else process_stream(start[0] or "")
        ended = exits[rank]
        later = [
            (t, process)
            for process, t in seen.items()
            if process != started
            and (start is None or (t > start[1] and ended.get(started or "", t) < t))
            and any(other != process and end < t for other, end in ended.items())
        ]
        if later:
            t, process = max(later)
            out[rank] = (process, t)
    return out


_DERIVED_STREAM = re.compile(r"\.(?:crash|shipper-\d+)$")
"""The suffix of a stream the shipper derives from a process's own (``agent/shipper.py``)."""


def process_stream(stream: str) -> str:
    """The agent stream a derived stream (``<stream>.crash``, ``<stream>.shipper-<pid>``) belongs to: the
    process that sent it."""
    return _DERIVED_STREAM.sub("", stream)


def _newest_start(latest_starts: Mapping[int, Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The newest ``rank_start`` of ``latest_starts`` (each rank's latest): the launch that declares the
    job's world. None when no rank started."""
    return max(latest_starts.values(), key=lambda s: s["time_ns"], default=None)


def retired_ranks(latest_starts: Mapping[int, Mapping[str, Any]]) -> dict[int, int]:
    """``{rank: time_ns}`` of the ranks the newest launch left out, with that launch's start: a job
    relaunched under the same id with fewer ranks (an elastic scale-down, a rerun on fewer GPUs). The
    newest ``rank_start`` (``latest_starts``: each rank's latest) declares the world; a rank at or beyond
    it whose own start is older belongs to the earlier run, however long its old process kept going."""
    newest = _newest_start(latest_starts)
    if newest is None:
        return {}
    world = int(newest.get("world_size") or 0)
    return {
        r: newest["time_ns"]
        for r, s in latest_starts.items()
        if 0 < world <= r and s["time_ns"] < newest["time_ns"]
    }


def settle_world(snap: JobSnapshot) -> JobSnapshot:
    """``snap`` with its ``world_size`` (``infer_world_size``) and without the ranks the newest launch left
    out in its per-rank fields (both snapshot builders end with it): a rank's old ``rank_start``, steps and
    accounting must not make it one of the current world's ranks. Records it sent after the launch (a
    second run under the same id) stay."""
    snap.retired = retired_ranks(snap.ranks)
    snap.world_size = infer_world_size(
        snap.ranks, snap.retired, snap.rank_last_seen_s, snap.heartbeats, snap.collectives
    )
    for r, launch_ns in snap.retired.items():
        snap.ranks.pop(r, None)
        if snap.steps.get(r) and snap.steps[r].last_step_end_ns < launch_ns:
            del snap.steps[r]
        if r in snap.agent_stats and snap.agent_stats[r]["time_ns"] < launch_ns:
            del snap.agent_stats[r]
        if snap.rank_last_seen_s.get(r, 0.0) * 1e9 < launch_ns:
            snap.rank_last_seen_s.pop(r, None)
    return snap


STALL_SAMPLES = 2000
"""How many of the newest ``stall_sample`` records a snapshot reads: a few per rank and stall, at most one
stall in 5 s per rank."""

MEMORY_WINDOW_NS = 3600 * 10**9
"""How far back from the newest ``memory`` record a snapshot reads them: an hour, 120 samples a rank."""


def memory_window(samples: list[Record]) -> list[Record]:
    """The samples of the ``MEMORY_WINDOW_NS`` up to the newest (``samples`` ordered by time)."""
    if not samples:
        return []
    since = samples[-1]["time_ns"] - MEMORY_WINDOW_NS
    return [m for m in samples if m["time_ns"] >= since]


def window_collectives(collectives: list[Record], window: int = COLLECTIVE_WINDOW) -> list[Record]:
    """Keep, per process group, the last ``window`` sequence numbers."""
    top: dict[str, int] = {}
    for c in collectives:
        top[c["pg"]] = max(top.get(c["pg"], 0), c["coll_seq"])
    return [c for c in collectives if c["coll_seq"] > top[c["pg"]] - window]


def snapshot_from_records(job: str, records: Iterable[Mapping[str, Any]]) -> JobSnapshot:
    """Build a snapshot from wire records of one job (all kinds mixed): for tests and small jobs."""
    from ddpscope.server.analysis.unused import aggregate_unused

    by_kind: dict[str, list[Record]] = {}
    for r in records:
        if r["job"] == job:
            by_kind.setdefault(r["kind"], []).append(dict(r))
    for recs in by_kind.values():
        recs.sort(key=lambda r: (r["time_ns"], r["rank"], r["seq"]))
    steps: dict[int, RankSteps] = {}
    for s in by_kind.get("step", []):
        cur = steps.get(s["rank"])
        if cur is None:
            steps[s["rank"]] = RankSteps(s["rank"], 1, s["step"], s["backward_end_ns"])
            continue
        cur.count += 1
        if s["backward_end_ns"] >= cur.last_step_end_ns:  # completed last: a restart's progress
            cur.last_step, cur.last_step_end_ns = s["step"], s["backward_end_ns"]
    seen: dict[int, float] = {}
    for recs in by_kind.values():
        note_seen(seen, recs)
    merged = merge_collectives(by_kind.get("collective", []), by_kind.get("collective_end", []))
    snap = JobSnapshot(
        job=job,
        world_size=0,
        ranks=_latest(by_kind.get("rank_start", [])),
        layouts=by_kind.get("layout", []),
        heartbeats=_latest(by_kind.get("heartbeat", [])),
        hangs=by_kind.get("hang", []),
        hang_resolved=by_kind.get("hang_resolved", []),
        rank_errors=by_kind.get("rank_error", []),
        rank_exits=by_kind.get("rank_exit", []),
        warnings=by_kind.get("warning", []),
        digests=by_kind.get("replica_digest", []),
        memory=memory_window(by_kind.get("memory", [])),
        stall_samples=by_kind.get("stall_sample", [])[-STALL_SAMPLES:],
        collectives=window_collectives(merged),
        steps=steps,
        unused=aggregate_unused(
            (s["rank"], s["step"], s["unused_parameters"])
            for s in latest_attempt(by_kind.get("step", []), by_kind.get("rank_start", []))
        ),
        agent_stats=_latest(by_kind.get("agent_stats", [])),
        rank_last_seen_s=seen,
        starts=by_kind.get("rank_start", []),
        stream_seen_ns=stream_seen(by_kind.get("agent_stats", [])),
    )
    return settle_world(snap)


def latest_attempt(records: Iterable[R], rank_starts: Iterable[Mapping[str, Any]]) -> list[R]:
    """The records that belong to each restarted rank's latest attempt (what the collector's step
    views show; ``storage._latest_attempt`` is the same test in SQL): see ``attempt_starts``."""
    starts = attempt_starts(rank_starts)
    return [r for r in records if not _before_start(r, starts.get(r["rank"]))]


def attempt_starts(rank_starts: Iterable[Mapping[str, Any]]) -> dict[int, tuple[str | None, int]]:
    """``{rank: (stream, time_ns)}`` of each rank whose earlier records are another attempt's: a rank
    restarted when its ``rank_start`` records come from more than one agent stream, and a record of it
    belongs to the latest attempt when it is on that start's stream or not older than it
    (``split_restart``'s rule). A rank the newest launch left out (``retired_ranks``) maps to
    ``(None, that launch's start)``: nothing it sent before then is current."""
    streams: dict[int, set[str]] = {}
    latest: dict[int, Mapping[str, Any]] = {}
    for s in sorted(rank_starts, key=lambda r: (r["time_ns"], r["seq"])):
        streams.setdefault(s["rank"], set()).add(s["stream"])
        latest[s["rank"]] = s
    out: dict[int, tuple[str | None, int]] = {
        rank: (latest[rank]["stream"], latest[rank]["time_ns"])
        for rank, seen in streams.items()
        if len(seen) > 1
    }
    out.update({rank: (None, launch_ns) for rank, launch_ns in retired_ranks(latest).items()})
    return out


def _before_start(rec: Mapping[str, Any], start: tuple[str | None, int] | None) -> bool:
    """``rec`` came from a process of its rank older than ``start`` (the stream and time of the rank's
    latest ``rank_start``): another stream, and earlier. The one restart rule of ``split_restart`` and
    ``latest_attempt``."""
    return start is not None and rec.get("stream") != start[0] and rec["time_ns"] < start[1]


def infer_world_size(
    ranks: Mapping[int, Mapping[str, Any]],
    retired: Mapping[int, int],
    seen: Iterable[int],
    heartbeats: Mapping[int, Mapping[str, Any]] | None = None,
    collectives: Iterable[Mapping[str, Any]] = (),
) -> int:
    """The job's world size: declared by the newest ``rank_start`` (a relaunch may have fewer ranks;
    ``retired`` are the ranks it left out) or, when no rank reached its DDP model (a rank that failed or
    stalled during set-up), by the heartbeats; else the highest rank heard from or named as a collective's
    member (a rank that never reported is still one its peers wait for), plus one."""
    newest = _newest_start(ranks)
    declared = int(newest.get("world_size") or 0) if newest is not None else 0
    launched_ns = newest["time_ns"] if newest is not None else 0
    # A heartbeat after the launch from one of its ranks: a larger relaunch still in its set-up.
    beating = max(
        (
            int(h.get("world_size") or 0)
            for r, h in (heartbeats or {}).items()
            if h["time_ns"] >= launched_ns and r not in retired
        ),
        default=0,
    )
    return max(declared, beating) or (max({*seen, *named_ranks(collectives)}, default=-1) + 1)


def stream_seen(agent_stats: Iterable[Mapping[str, Any]]) -> dict[tuple[int, str], int]:
    """``JobSnapshot.stream_seen_ns`` from ``agent_stats`` records."""
    out: dict[tuple[int, str], int] = {}
    for a in agent_stats:
        key = (a["rank"], a["stream"])
        out[key] = max(out.get(key, 0), a["time_ns"])
    return out


def _latest(records: Iterable[Record]) -> dict[int, Record]:
    """The newest record per rank (input ordered by time_ns)."""
    out: dict[int, Record] = {}
    for r in records:
        out[r["rank"]] = r
    return out


def load_snapshot(storage: Storage, job: str) -> JobSnapshot | None:
    """Read one job's snapshot from storage; None when the job is unknown."""
    return storage.load_snapshot(job)


def parameter_order(snapshot: JobSnapshot, rank: int) -> list[str]:
    """The rank's parameter names in the engine's index order (torch's "Parameter indices" and replica
    digests refer to it), from its newest layout record that carries them; [] when none does."""
    for lay in reversed(snapshot.layouts):
        if lay["rank"] == rank and lay.get("parameter_order"):
            return list(lay["parameter_order"])
    return []
