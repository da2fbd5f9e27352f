"""Job status and the liveness facts it rests on: who exited, who died, who went silent, who hangs.

``job_status(snapshot, now_s)`` returns ``'failed'``, ``'finished'``, ``'hung'`` or ``'running'``, in that
order of precedence:

- **failed**: a rank died of an error (a fatal ``rank_error``, a ``rank_exit`` with reason ``'error'``),
  crashed without a word (it stopped reporting, never exited, and its peers then lost their connections),
  was stopped by SIGTERM while it hung (a scheduler's time limit ending a hung job is not a finish),
  while it had waited in a collective for ``silent_after_s`` (a hang cancelled before the rank's hang
  timeout, often minutes, let it report one) or while it had been silent for ``silent_after_s`` (its
  Python thread held the GIL, or it was frozen: stopping it does not make it a finish; a rank that
  never reported an exit counts when its peers' stop found it that long silent), or
  the whole job has been quiet without a clean exit for ``dead_after_s`` (killed with all its ranks at
  once, its node lost): nothing will come from it any more, and a dead job must neither read as hung
  nor page as one forever.
- **finished**: every rank of ``world_size`` sent ``rank_exit`` (a SIGTERM to a job that was making
  progress, a cancellation or a preemption, counts: nothing went wrong inside the job).
- **hung**: a hang report not yet resolved, or a silent rank (no record for ``silent_after_s``) while the
  job is unfinished, or the whole job quiet without a clean exit for less than ``dead_after_s`` (killed,
  stopped or cut off from the collector for a moment: it must not read as running).
- **running**: otherwise.

A hang report of a rank stuck in its own code (nothing in flight, no bucket pending: a long evaluation, a
checkpoint write) is a hang only while another rank waits for it in a collective, recorded or not
(``stuck.waiters``): when every rank is busy in its own code, no rank waits for another and nothing is hung.

``liveness(snapshot, now_s)`` exposes the same facts per rank for ``incidents.diagnose``. Only events after
a rank's latest ``rank_start`` count (a restarted rank leaves its old errors behind), and an error after a
clean ``rank_exit`` is ignored (torch on gloo sometimes aborts at interpreter exit after training ended).
Pure functions of a ``JobSnapshot``: no database, no HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpscope.server.analysis.incident_model import STOP_SIGNALS
from ddpscope.server.analysis.shared_job import without_twins
from ddpscope.server.analysis.snapshot import JobSnapshot, named_ranks, split_restart
from ddpscope.server.analysis.stuck import is_hang, wait_spans

DEFAULT_SILENT_AFTER_S = 10.0
"""A rank with no record for this long is silent: a few heartbeat intervals, so one late heartbeat or a
slow batch upload is not mistaken for a stopped process."""
STOP_BURST_S = 1.0
"""What a rank sends within this long before its ``rank_exit`` may be sent *because* it was stopped, not
before: the signal frees a rank whose Python thread held the GIL, and its starved threads (the watchdog's
overdue heartbeat, an async collective's end) run before or while the handler emits the exit; a rank
blocked in C is flushed by the SIGTERM watcher 0.5 s after the signal (``sigterm_watcher.GRACE_S``)."""
DEFAULT_DEAD_AFTER_S = 120.0
"""A job none of whose ranks has sent anything for this long, without every rank exiting cleanly, is
dead (failed): 60 missed heartbeats, twice the time DDPRankSilent waits, and longer than the shipper's
retry backoff, so a collector restart or a short network cut does not end a live job."""

LOST_PEER_ERROR = re.compile(
    r"connection (?:reset|closed|refused|aborted)|(?:reset|closed) by peer|broken pipe|"
    r"socket closed|end of file|communicator (?:was )?aborted|peer .*(?:died|exited)",
    re.IGNORECASE,
)
"""Errors a rank gets when a peer's process went away, e.g. gloo's "Connection reset by peer" ~20-60 ms
after a peer is killed."""
TIMEOUT_ERROR = re.compile(r"timed out|timeout", re.IGNORECASE)
"""Errors a rank gets when its process group's timeout ran out waiting for a peer: gloo's "Timed out
waiting 5000ms for recv", NCCL's "Watchdog caught collective operation timeout"."""
SECONDARY_ERROR = re.compile(f"{LOST_PEER_ERROR.pattern}|{TIMEOUT_ERROR.pattern}", re.IGNORECASE)
"""Errors a rank gets *because of* another rank (its peer died or never answered): the victims' side.
A timeout says only that a peer did not answer: it may be stopped or stuck, not dead."""

Record = dict[str, Any]


MONITORED_BARRIER = re.compile(r"\bRanks? ([\d, ]+) failed to pass monitoredBarrier")
"""torch's ``monitored_barrier`` error on rank 0: it names the ranks that never reached the barrier
(its own timeout follows in the message, but the error is a diagnosis, not a victim's)."""


AFTER_PEER_LOSS = "after_peer_loss"
"""Set by ``liveness`` on a copy of an error that a rank raised after it had lost a peer (see
``is_secondary``)."""


def is_secondary(error: Mapping[str, Any]) -> bool:
    """True for an error caused by a peer (lost connection, timeout), not by this rank itself; also for
    any error the rank raised after one such (``AFTER_PEER_LOSS``): a loop that caught the lost connection
    and gave up (``sys.exit(1)``, its own exception) or retried the step (torch's next forward refuses,
    blaming unused parameters) fails because of the peer, not of its own code."""
    if error.get(AFTER_PEER_LOSS):
        return True
    text = f"{error.get('error_type', '')}: {error.get('message', '')}"
    return bool(SECONDARY_ERROR.search(text)) and not MONITORED_BARRIER.search(text)


@dataclass(slots=True)
class Liveness:
    """Per-rank facts at ``now_s`` (aligned-clock seconds); see ``liveness``."""

    now_s: float
    silent_after_s: float
    ranks: list[int]
    """Every rank of the job: range(world_size) plus any rank seen beyond it."""
    last_alive_s: dict[int, float] = field(default_factory=dict)
    """Newest record of the rank (any kind, heartbeats included); absent when never seen."""
    exits: dict[int, Record] = field(default_factory=dict)
    """The rank's ``rank_exit`` (latest, after its latest start)."""
    fatal: dict[int, Record] = field(default_factory=dict)
    """The rank's first fatal ``rank_error`` that counts (after its start, before any clean exit)."""
    errors: list[Record] = field(default_factory=list)
    """Every ``rank_error`` that counts, fatal or not, by time, up to each rank's first fatal one."""
    active_hangs: dict[int, Record] = field(default_factory=dict)
    """The rank's latest hang report not followed by ``hang_resolved``, an exit or a fatal error."""
    stopped_hangs: dict[int, Record] = field(default_factory=dict)
    """The rank's hang report that was still unresolved when the rank was stopped by SIGTERM."""
    stopped_waits: dict[int, Record] = field(default_factory=dict)
    """The rank's oldest collective still open when it was stopped by SIGTERM or SIGINT, if it had been
    open for ``silent_after_s`` by then: stopped while it waited, whether or not a hang report came."""
    stopped_silent: dict[int, float] = field(default_factory=dict)
    """Ranks that had sent nothing for ``silent_after_s`` when a signal stopped them, with when each fell
    quiet (aligned-clock seconds): by their own ``rank_exit`` (``_quiet_before_stop``), or, for a rank
    that never reported an exit (killed after the signal, or still frozen), by its peers' stop."""
    silent: list[int] = field(default_factory=list)
    """Ranks with no record for ``silent_after_s`` (or never seen while others hang), not exited, not
    dead of an error, while another rank is alive or waiting."""
    crashed: list[int] = field(default_factory=list)
    """Ranks that went quiet without an error or exit before their peers lost their connections."""
    lost: bool = False
    """Every rank still expected to report has been quiet for ``silent_after_s``."""
    dead_after_s: float = DEFAULT_DEAD_AFTER_S
    dead: bool = False
    """``lost`` for ``dead_after_s``: the job is gone (killed with all its ranks, its node lost)."""
    hangs_at_death: dict[int, Record] = field(default_factory=dict)
    """The hangs that were still active when a dead job fell quiet: they ended with it."""
    listening_since_s: float | None = None
    """When the collector reading this started (``JobSnapshot.listening_since_s``)."""

    @property
    def finished(self) -> bool:
        return bool(self.ranks) and all(r in self.exits for r in self.ranks)

    @property
    def failed(self) -> bool:
        errored_exit = any(e.get("reason") == "error" for e in self.exits.values())
        stopped_stuck = bool(self.stopped_hangs) or bool(self.stopped_waits) or bool(self.stopped_silent)
        return bool(self.fatal) or bool(self.crashed) or errored_exit or stopped_stuck or self.dead

    @property
    def hung(self) -> bool:
        return bool(self.active_hangs) or bool(self.silent) or self.lost

    @property
    def status(self) -> str:
        """``'failed'``, ``'finished'``, ``'hung'`` or ``'running'``, in that order of precedence."""
        if self.failed:
            return "failed"
        if self.finished:
            return "finished"
        if self.hung:
            return "hung"
        return "running"

    @property
    def ended(self) -> bool:
        """Failed or finished: nothing more is expected from the job (its status can no longer change
        with time alone, only with new records, e.g. a restarted rank)."""
        return self.failed or self.finished

    def stopped_at_s(self, rank: int) -> float | None:
        """When a signal (SIGTERM, SIGINT) stopped the rank: its own exit says so, or, for a rank that never
        reported an exit, the first of its peers' stops; None when no rank was stopped."""
        exit_ = self.exits.get(rank)
        if exit_ is not None:
            return _s(exit_) if exit_.get("reason") in STOP_SIGNALS else None
        return min((_s(e) for e in self.exits.values() if e.get("reason") in STOP_SIGNALS), default=None)

    def silence(self, rank: int, until_s: float) -> str:
        """ "had sent nothing for 25 s by then, heartbeats included: ..." when ``rank``'s newest record (of any
        kind) is ``silent_after_s`` or more older than ``until_s`` (a peer's wait ending, a peer's error): its
        whole process fell quiet, the watchdog's heartbeats too, which no code path of the rank's does by
        itself. '' otherwise, and for a rank never heard of or one that exited."""
        last = self.last_alive_s.get(rank)
        if last is None or rank in self.exits or until_s - last < self.silent_after_s:
            return ""
        return (
            f"had sent nothing for {until_s - last:.0f} s by then, heartbeats included: its whole process was "
            "stopped (SIGSTOP, Ctrl-Z, a debugger such as gdb attached), froze (its host swapping or hung), or "
            "lost its network"
        )

    def seen_until_s(self, rank: int) -> float:
        """How far the rank's story runs: now, or its last sign of life once the whole job went quiet
        (killed, stopped), or its exit: a wait or a hang ended then, it does not keep growing."""
        exit_ = self.exits.get(rank)
        if exit_ is not None:
            return min(self.now_s, _s(exit_))
        last = self.last_alive_s.get(rank)
        return last if self.lost and last is not None else self.now_s

    def age_s(self, rank: int) -> float | None:
        """How long the rank has been quiet. A rank last heard before the collector started is given
        ``silent_after_s`` of listening first: after a collector restart the spooled records of a live
        job take a few seconds to arrive, and until then its ranks only *look* quiet."""
        seen = self.last_alive_s.get(rank)
        if seen is None:
            return None
        since = self.listening_since_s
        if since is not None and seen < since and 0.0 <= self.now_s - since < self.silent_after_s:
            return self.now_s - since
        return self.now_s - seen


def _s(record: Mapping[str, Any]) -> float:
    return float(record["time_ns"]) / 1e9


def unobserved_ranks(snapshot: JobSnapshot) -> set[int]:
    """Ranks some rank's ``rank_start`` names as running without ddpscope (``unobserved_ranks``)."""
    return {int(r) for start in snapshot.ranks.values() for r in start.get("unobserved_ranks") or ()}


def liveness(
    snapshot: JobSnapshot,
    now_s: float,
    *,
    silent_after_s: float = DEFAULT_SILENT_AFTER_S,
    dead_after_s: float = DEFAULT_DEAD_AFTER_S,
) -> Liveness:
    """Work out, for every rank, whether it exited, died, hangs, went silent or crashed (its current
    process: what a restarted rank's earlier process left is set aside)."""
    snapshot = split_restart(without_twins(snapshot))[0]  # a duplicated rank's twin is not the rank
    heard = set(snapshot.rank_last_seen_s) | set(snapshot.heartbeats) | set(snapshot.ranks)
    seen_ranks = heard | named_ranks(snapshot.collectives)
    # Ranks a started rank found running without ddpscope send nothing by design: not silent, not waited for.
    ranks = sorted((set(range(snapshot.world_size)) | seen_ranks) - (unobserved_ranks(snapshot) - heard))
    live = Liveness(
        now_s=now_s,
        silent_after_s=silent_after_s,
        ranks=ranks,
        dead_after_s=dead_after_s,
        listening_since_s=snapshot.listening_since_s,
    )
    started = {r: _s(rec) for r, rec in snapshot.ranks.items()}

    def counts(rec: Mapping[str, Any]) -> bool:
        return _s(rec) >= started.get(rec["rank"], float("-inf"))

    for r in ranks:
        times = [snapshot.rank_last_seen_s[r]] if r in snapshot.rank_last_seen_s else []
        if r in snapshot.heartbeats:
            times.append(_s(snapshot.heartbeats[r]))
        if times:
            live.last_alive_s[r] = max(times)
    for e in sorted(snapshot.rank_exits, key=_s):
        if counts(e):
            live.exits[e["rank"]] = e
    peer_lost: set[int] = set()
    """Ranks that have reported a lost connection or a timeout (in their current process)."""
    for err in sorted(snapshot.rank_errors, key=_s):
        if not counts(err):
            continue
        clean_exit = live.exits.get(err["rank"])
        if clean_exit is not None and clean_exit.get("reason") == "finished" and _s(clean_exit) <= _s(err):
            continue
        if err["rank"] in live.fatal:
            # Already dead of an earlier error: a later one (an abort while exiting, the same exception
            # reported again) is the same death, not a new cause.
            continue
        if is_secondary(err):
            peer_lost.add(err["rank"])
        elif err["rank"] in peer_lost:
            err = {**err, AFTER_PEER_LOSS: True}
        live.errors.append(err)
        if err.get("fatal"):
            live.fatal.setdefault(err["rank"], err)
    # The engine reports an exception leaving its forward at once (a loop may catch it and go on); if
    # nothing caught it, the same exception killed the rank: one error, the fatal one.
    died_of = {(e["rank"], e.get("error_type"), e.get("message")) for e in live.fatal.values()}
    live.errors = [
        e
        for e in live.errors
        if e.get("fatal") or (e["rank"], e.get("error_type"), e.get("message")) not in died_of
    ]
    live.crashed = _crashed(live)
    # A crashed rank's hang ended with it: no hang_resolved or exit will ever come.
    live.active_hangs = {
        r: h for r, h in _active_hangs(snapshot, live, counts).items() if r not in live.crashed
    }
    live.stopped_hangs = _stopped_hangs(snapshot, live, counts)
    live.stopped_waits = _stopped_waits(snapshot, live)
    live.stopped_silent = _stopped_silent(snapshot, live)
    live.silent = _silent(live)
    if live.dead:
        # No hang_resolved or exit will ever come from a dead job: its hangs ended with it.
        live.hangs_at_death, live.active_hangs = live.active_hangs, {}
    return live


def _active_hangs(snapshot: JobSnapshot, live: Liveness, counts: Any) -> dict[int, Record]:
    ends: dict[int, float] = {}
    for rec in [*snapshot.hang_resolved, *live.exits.values(), *live.fatal.values()]:
        ends[rec["rank"]] = max(ends.get(rec["rank"], float("-inf")), _s(rec))
    active: dict[int, Record] = {}
    waits = wait_spans(snapshot)
    for h in sorted(snapshot.hangs, key=_s):
        if counts(h) and _s(h) > ends.get(h["rank"], float("-inf")) and is_hang(snapshot, h, waits):
            active[h["rank"]] = h
    return active


def _stopped_hangs(snapshot: JobSnapshot, live: Liveness, counts: Any) -> dict[int, Record]:
    """Hangs that ended with the rank's SIGTERM exit rather than with progress: a time limit or an
    operator killing a hung job."""
    out: dict[int, Record] = {}
    waits = wait_spans(snapshot)
    for r, exit_ in live.exits.items():
        if exit_.get("reason") not in STOP_SIGNALS:
            continue
        resolved_s = max((_s(x) for x in snapshot.hang_resolved if x["rank"] == r), default=float("-inf"))
        hangs = [
            h
            for h in snapshot.hangs
            if h["rank"] == r
            and counts(h)
            and resolved_s < _s(h) <= _s(exit_)
            and is_hang(snapshot, h, waits)
        ]
        if hangs:
            out[r] = max(hangs, key=_s)
    return out


def _stopped_waits(snapshot: JobSnapshot, live: Liveness) -> dict[int, Record]:
    """Collectives a rank was still waiting in, for ``silent_after_s`` or longer, when a signal stopped
    it. With the default hang timeout (5 minutes) a job cancelled after a minute of waiting for a stuck
    peer has no hang report, and its ranks' exits would read as a clean finish. A wait that ended in an
    error is one too: the peer stopped first, and the lost connection ended the wait as the rank left."""
    out: dict[int, Record] = {}
    for c in snapshot.collectives:
        exit_ = live.exits.get(c["rank"])
        if exit_ is None or exit_.get("reason") not in STOP_SIGNALS:
            continue
        if c.get("end_ns") is not None and c.get("ok"):
            continue
        if c["start_ns"] <= int(exit_["time_ns"]) - live.silent_after_s * 1e9:
            before = out.get(c["rank"])
            if before is None or c["start_ns"] < before["start_ns"]:
                out[c["rank"]] = c
    return out


def _stopped_silent(snapshot: JobSnapshot, live: Liveness) -> dict[int, float]:
    """Ranks silent for ``silent_after_s`` when they were stopped, and when they fell quiet. A rank whose
    Python thread holds the GIL (a regex backtracking, a C extension that keeps it) or that is frozen
    (SIGSTOP) sends nothing, and is ``rank_silent`` while it lasts; once a scheduler's time limit or
    scancel stops it, its exit alone would read as a cancelled job's and lose the culprit.

    Heartbeats tell, as they are the one record a live rank sends every few seconds whatever it does. A
    rank that reported its stop counts when its latest heartbeat came that long before its exit, or came
    with the stop (within ``STOP_BURST_S``) saying its thread could not run for that long before
    (``silent_s``): the collector keeps a rank's latest heartbeat only, and the one a starved watchdog sends
    as the signal frees the GIL replaces the one from before the silence. A rank that never reported an
    exit (SIGKILLed after the SIGTERM it could not handle, or still frozen) counts when its last record came
    that long before the first of its peers' stops."""
    out: dict[int, float] = {}
    for r, exit_ in live.exits.items():
        stopped_s = live.stopped_at_s(r)
        if stopped_s is None:
            continue
        beat = snapshot.heartbeats.get(r)
        if beat is None or beat.get("stream") != exit_.get("stream"):
            continue  # no watchdog in that process, or the beat is an earlier process's
        quiet_s = _s(beat)
        if stopped_s - quiet_s <= STOP_BURST_S:
            quiet_s -= float(beat.get("silent_s") or 0.0)
        if stopped_s - quiet_s >= live.silent_after_s:
            out[r] = quiet_s
    for r in live.ranks:
        seen = live.last_alive_s.get(r)
        gone = r in live.exits or r in live.fatal or r in live.crashed
        peers_stopped_s = None if gone else live.stopped_at_s(r)
        if peers_stopped_s is not None and seen is not None and peers_stopped_s - seen >= live.silent_after_s:
            out[r] = seen
    return out


def _crashed(live: Liveness) -> list[int]:
    """Ranks that said nothing after their peers started reporting lost connections.

    A SIGKILLed rank cannot report; its peers get "Connection reset by peer" tens of milliseconds later.
    So a rank with no error and no exit whose last record is older than the first such victim error is
    the one that died. (A healthy rank that has not yet noticed can match for a moment; its next record
    moves it out of the set, so the answer settles within a heartbeat.)
    """
    # Only a lost connection says a peer's process is gone: a timeout also follows a rank that is
    # stopped (SIGSTOP) or stuck, which is silent, not crashed.
    victims = [
        e for e in live.errors if is_secondary(e) and LOST_PEER_ERROR.search(str(e.get("message", "")))
    ]
    if not victims:
        return []
    first_victim_s = min(_s(e) for e in victims)
    out = []
    for r in live.ranks:
        if r in live.exits or any(e["rank"] == r for e in live.errors):
            continue
        seen = live.last_alive_s.get(r)
        if seen is None or seen <= first_victim_s:
            out.append(r)
    return out


def _silent(live: Liveness) -> list[int]:
    if live.finished:
        return []
    dead = set(live.exits) | set(live.fatal) | set(live.crashed)
    candidates = [r for r in live.ranks if r not in dead]
    quiet = [r for r in candidates if (a := live.age_s(r)) is None or a > live.silent_after_s]
    if candidates and len(quiet) == len(candidates):
        if live.fatal and all(r not in live.last_alive_s for r in candidates):
            # Only ranks never heard of are left, and a rank died of an error: a job that failed as it
            # started (a rendezvous that timed out waiting for them), not one that fell silent.
            return []
        # Nobody is left to wait for anyone: the whole job stopped reporting (killed by the scheduler,
        # all stopped, or cut off from the collector). No single rank is to blame.
        live.lost = True
        ages = [a for r in candidates if (a := live.age_s(r)) is not None]
        live.dead = bool(ages) and min(ages) >= live.dead_after_s
        return []
    # A rank never seen at all only counts as silent when the others are demonstrably waiting.
    return [r for r in quiet if r in live.last_alive_s or live.active_hangs]


def job_status(snapshot: JobSnapshot, now_s: float, *, silent_after_s: float = DEFAULT_SILENT_AFTER_S) -> str:
    """``'failed'``, ``'finished'``, ``'hung'`` or ``'running'`` (see the module docstring)."""
    return liveness(snapshot, now_s, silent_after_s=silent_after_s).status
