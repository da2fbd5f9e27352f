"""Hang reports, read against the other ranks: who this rank waits for, and where each rank is stuck.

A hang report says where one rank is (phase, step, the collective in flight, pending buckets, every
thread's stack). On its own it cannot say *why*; the culprit is found by reading the other ranks'
evidence at the collective the rank waits in:

- a member of the group that **never issued** that collective (its highest sequence number is lower),
  or **entered it late** (its own record starts well after the wait began: it was stuck elsewhere
  and the wait ended, or ended in a timeout, once it arrived);
- a rank already blamed by another diagnosis (a mismatch, a crash, an early exit);
- the rank itself, when the other diagnoses blame it, when its own buckets wait for gradients that
  never came, or when it is stuck **outside any collective** (a data loader, a forward that never
  returns) while other ranks wait in one.

A rank blocked in a collective ddpscope does not record (``native_wait``: the C++ all-reduce of a DDP
model it does not observe) has no sequence number to match: it waits for the peers whose own reports
place them **elsewhere** at that moment (in their own code, or blocked in another collective).

"Every rank issued this collective: the wait is inside the backend" is said only when every member's
record of that collective is there and none came late.

A hang's incident stays ``active`` unless the rank made progress again (``hang_resolved``) or exited
cleanly: a hang that ended in the rank's death or a SIGTERM is part of the failure's explanation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpscope.agent.exit_wait import ADVICE as EXIT_ADVICE
from ddpscope.agent.exit_wait import HANDLER_ADVICE, holders_phrase
from ddpscope.agent.torch_waits import GROUP_CONSTRUCTION_PLACE, RENDEZVOUS_PLACE, TorchWait
from ddpscope.server.analysis.collective_diagnosis import CollectiveIndex
from ddpscope.server.analysis.incident_model import (
    AFTER_FORWARD,
    P2P_OPS,
    STOP_SIGNALS,
    Incident,
    Record,
    describe,
    never_issued,
    ranks_phrase,
    record_s,
    user_frame,
)
from ddpscope.server.analysis.native_wait import (
    exiting,
    joining_threads,
    main_blocked,
    main_stack,
    native_wait,
    thread_words,
    training_thread,
)
from ddpscope.server.analysis.restart_race import ADVICE as RESTART_ADVICE
from ddpscope.server.analysis.restart_race import HANG_CAUSE as RESTART_HANG_CAUSE
from ddpscope.server.analysis.restart_race import relaunched_before_start
from ddpscope.server.analysis.snapshot import JobSnapshot, p2p_pair
from ddpscope.server.analysis.status import Liveness
from ddpscope.server.analysis.stuck import (
    FROM_HANG_REPORT,
    Stuck,
    dead_thread_note,
    debugger_wait,
    hang_start_s,
    how_stuck,
    in_own_code,
    is_hang,
    main_site,
    own_code_hangs,
    span_s,
    stuck_outside,
    wait_spans,
    waiters,
    waits_for_loader,
    waits_on,
    workers_words,
)
from ddpscope.server.analysis.wait_graph import WaitGraph
from ddpscope.server.analysis.wrappers import wrappers_differ

LATE_AFTER_S = 1.0
"""A peer whose record of the awaited collective starts this much after the wait began (and at least
half the stall) entered it late: ranks in lockstep enter a collective within milliseconds."""

_OWN_THREADS = "ddpscope-"
"""ddpscope's own threads (agent worker, watchdog): never where a user's rank is stuck."""


def hang_incidents(
    snapshot: JobSnapshot,
    live: Liveness,
    colls: CollectiveIndex,
    missing: Sequence[Incident],
    blame: Mapping[int, str],
    graph: WaitGraph,
) -> list[Incident]:
    """One incident per (rank, step, phase) hang, the newest report of each."""
    own_code = own_code_hangs(snapshot)
    waiting = sorted(r for r, h in live.active_hangs.items() if h.get("inflight") or native_wait(h))
    waiting += sorted(r for seqs in colls.waits.values() for r in seqs if r not in waiting)
    blocked = _Blocked(snapshot)
    waits = wait_spans(snapshot)
    out = []
    seen: set[tuple[Any, ...]] = set()
    for h in sorted(snapshot.hangs, key=record_s, reverse=True):
        key = (h["rank"], h.get("step"), h.get("phase"))
        if key in seen or not is_hang(snapshot, h, waits):
            # A stall in its own code no peer waited for (every rank evaluating): not a hang.
            continue
        seen.add(key)
        # Where each peer was stuck *while this rank waited*: a later stall of the same peer (another
        # evaluation, after the last step) is not why this one waited.
        stuck = stuck_outside(snapshot, at_s=record_s(h), own_code=own_code) if own_code else {}
        reading = _HangReading(h, snapshot, live, colls, stuck, blocked)
        out.append(reading.incident(missing, blame, waiting, graph))
    return out


class _Blocked:
    """The hang reports that show their rank blocked (in a collective, recorded or not, or awaiting
    gradients), grouped by where, built on first use: each rank blocked in a collective ddpscope does not
    record looks for the ranks somewhere else, and in a large job nearly all are where it is."""

    def __init__(self, snapshot: JobSnapshot) -> None:
        self.snapshot = snapshot
        self._by_place: dict[tuple[TorchWait | None, str | None], list[tuple[float, float, Record]]] = {}
        self._built = False

    def elsewhere(self, here: tuple[TorchWait | None, str | None], at_s: float) -> dict[int, Record]:
        """Per rank, its latest blocked report covering ``at_s`` at a place other than ``here``."""
        if not self._built:
            self._built = True
            for h in self.snapshot.hangs:
                if not in_own_code(h):
                    there = native_wait(h)
                    start, end = span_s(self.snapshot, h)
                    key = (there, main_site(h)) if there is not None else (None, None)
                    self._by_place.setdefault(key, []).append((start, end, h))
        out: dict[int, Record] = {}
        for place, reports in self._by_place.items():
            if place == here:
                continue
            for start, end, report in reports:
                r = report["rank"]
                if start <= at_s <= end and (r not in out or record_s(report) > record_s(out[r])):
                    out[r] = report
        return out


def in_set_up(wait: TorchWait | None) -> bool:
    """Blocked in init_process_group's rendezvous or a process group's construction: waiting for every rank
    of the job (or group) to arrive, which a rank blocked in the other of the two has done or will do."""
    return wait is not None and wait.place.startswith((RENDEZVOUS_PLACE, GROUP_CONSTRUCTION_PLACE))


class _HangReading:
    """One hang report and what the rest of the job says about it."""

    def __init__(
        self,
        h: Record,
        snapshot: JobSnapshot,
        live: Liveness,
        colls: CollectiveIndex,
        stuck: Mapping[int, Stuck],
        blocked: _Blocked | None = None,
    ) -> None:
        self.h, self.snapshot, self.live, self.colls, self.stuck = h, snapshot, live, colls, stuck
        self.blocked = blocked
        self.rank: int = h["rank"]
        inflight = sorted(h.get("inflight") or [], key=lambda c: c["start_ns"])
        self.wait: Record | None = None
        if inflight:
            c = inflight[0]
            # The collective record has what the compact in-flight entry may lack (call site, step).
            self.wait = {**c, **colls.by_pg.get(c["pg"], {}).get(self.rank, {}).get(c["coll_seq"], {})}
        self.native = None if inflight else native_wait(h)
        """Blocked in a collective ddpscope does not record: where."""

    def where(self) -> str | None:
        """The collective this rank waits in, in words; None when it waits in none."""
        if self.wait is not None:
            return f"{describe(self.wait)}, collective #{self.wait['coll_seq']} of group {self.wait['pg']}"
        return self.native.place if self.native is not None else None

    def _end(self) -> tuple[str, float | None]:
        """('active' | 'resolved' | 'sigterm' | 'sigint' | 'died' | 'exited' | 'lost', when it ended;
        'sigterm'/'sigint': stopped by that signal; 'lost': the whole job fell quiet and is dead)."""
        r, t = self.rank, record_s(self.h)
        resolved = [x for x in self.snapshot.hang_resolved if x["rank"] == r and record_s(x) >= t]
        if resolved:
            first = min(resolved, key=record_s)
            hang_s = float(first.get("hang_s") or 0.0)
            return "resolved", hang_start_s(self.h) + hang_s if hang_s else record_s(first)
        if self.live.active_hangs.get(r) is self.h:
            return "active", None
        exit_ = self.live.exits.get(r)
        if exit_ is not None and record_s(exit_) >= t:
            reason = exit_.get("reason")
            state = reason if reason in STOP_SIGNALS else "exited" if reason == "finished" else "died"
            return state, record_s(exit_)
        fatal = self.live.fatal.get(r)
        if fatal is not None and record_s(fatal) >= t:
            return "died", record_s(fatal)
        if r in self.live.crashed:
            return "died", self.live.last_alive_s.get(r)
        if self.live.hangs_at_death.get(r) is self.h:
            return "lost", self.live.last_alive_s.get(r)
        return "active", None

    def _duration_s(self, ended_s: float | None) -> float:
        start = hang_start_s(self.h)
        if ended_s is not None:
            return max(0.0, ended_s - start)
        return max(float(self.h.get("stalled_s", 0.0)), self.live.seen_until_s(self.rank) - start)

    def _peers_at_wait(self) -> dict[int, str]:
        """Culprits among the peers of the awaited collective, with why: never issued it, or came late."""
        wait = self.wait
        if wait is None:
            return self._peers_elsewhere() if self.native is not None else {}
        pg, seq = wait["pg"], wait["coll_seq"]
        why: dict[int, str] = {}
        late_after = max(LATE_AFTER_S, 0.5 * float(self.h.get("stalled_s", 0.0)))
        # Read from the index's per-number lists: every hanging rank of a large job asks the same.
        for r in self.colls.behind(pg, seq, self.live):
            if r != self.rank:
                why[r] = f"{never_issued(pg, seq)}{self._meanwhile(r)}"
        for start_ns, r in self.colls.entered(pg, seq):
            late = (start_ns - wait["start_ns"]) / 1e9
            if late < late_after:
                break  # latest first: the rest came in time
            if r != self.rank and r not in why:
                why[r] = f"entered collective #{seq} {late:.0f} s late{self._meanwhile(r)}"
        return dict(sorted(why.items()))

    def _peers_elsewhere(self, *, blocked_too: bool = True) -> dict[int, str]:
        """For a wait in a collective ddpscope does not record: the peers whose reports place them
        elsewhere at the time of this one, with where. Without a sequence number nothing says who never
        issued the collective; a peer stuck in its own code or blocked in another one is not in it. A peer
        blocked at the same place (same machinery, same line of the user's) waits alongside this rank.
        ``blocked_too=False``: only the peers stuck in their own code (see ``through_past_waits``)."""
        at_s = record_s(self.h)
        stuck = self.stuck or stuck_outside(self.snapshot, at_s=at_s)
        why = {r: st.phrase() for r, st in stuck.items() if r != self.rank}
        if not blocked_too:
            return why
        blocked = self.blocked or _Blocked(self.snapshot)
        for r, peer in sorted(blocked.elsewhere((self.native, main_site(self.h)), at_s).items()):
            if r == self.rank or r in why:
                continue
            there = native_wait(peer)
            if in_set_up(self.native) and in_set_up(there):
                # Through the rendezvous into its group's construction, or still in the rendezvous: either
                # way waiting for the same ranks this one waits for, never what holds it.
                continue
            if there is not None:
                why[r] = (
                    f"blocked in {there.place} at {main_site(peer)} meanwhile{wrappers_differ(self.h, peer)}"
                )
            elif peer.get("inflight"):
                c = min(peer["inflight"], key=lambda x: x["start_ns"])
                why[r] = (
                    f"blocked in {describe(c)}, collective #{c['coll_seq']} of group {c['pg']}, meanwhile"
                    + wrappers_differ(self.h, peer)
                )
            else:  # its buckets wait for gradients: its backward has not got that far
                why[r] = f"in its own backward at step {peer.get('step')}, still waiting for its gradients"
        return dict(sorted(why.items()))

    def _came_late(self) -> dict[int, str]:
        """For a wait in the rendezvous or a group's construction: the ranks that got there only after this
        one had waited a hang timeout, known from their first ``rank_start`` (once the wait ended)."""
        began_s = hang_start_s(self.h)
        reported_s = record_s(self.h)
        first: dict[int, float] = {}
        for start in self.snapshot.starts:
            first[start["rank"]] = min(first.get(start["rank"], record_s(start)), record_s(start))
        return {
            r: f"reached init_process_group late, ready only {t - began_s:.0f} s after this rank began waiting: "
            "code of its own before it (a dataset downloaded or prepared on that rank alone) ran that much longer"
            for r, t in sorted(first.items())
            if r != self.rank and t > reported_s
        }

    def _latest_report(self, rank: int) -> Record | None:
        """``rank``'s latest hang report of a stall that had begun by this one's report, if any."""
        t = record_s(self.h)
        return max(
            (x for x in self.snapshot.hangs if x["rank"] == rank and hang_start_s(x) <= t),
            key=record_s,
            default=None,
        )

    def _own_wrapper_differs(self) -> str:
        """'; it is inside the constructor of torch's DistributedDataParallel while rank 1 is inside that of
        ddpscope's: ...' when a peer's report has it in another DDP class's constructor than this rank's
        (the peer's own report says it the other way round); '' otherwise."""
        for r in sorted({x["rank"] for x in self.snapshot.hangs} - {self.rank}):
            report = self._latest_report(r)
            if report is not None and (differ := wrappers_differ(report, self.h)):
                return differ
        return ""

    def _meanwhile(self, rank: int) -> str:
        stuck = self.stuck.get(rank)
        if stuck:
            return f"; {stuck.phrase()}"
        report = self.live.active_hangs.get(rank)  # not every report: each waiting rank asks this
        if report is not None and (hooked := hook_wait(report)):
            return f"; {hooked}"
        if differ := wrappers_differ(self.h, self._latest_report(rank)):
            return differ
        there = native_wait(report) if report is not None else None
        if report is not None and there is not None:
            return f"; blocked in {there.place} at {main_site(report)}, a collective ddpscope does not record"
        if rank not in self.live.last_alive_s:
            # Known only from its peers' point-to-point or group records: stuck or slow before anything
            # ddpscope measures (its set-up, a process group it creates), or never started.
            return (
                "; it has never reported: it is stuck or slow before its first measured collective, or not "
                "running (or running without ddpscope: DDPSCOPE_DISABLED set on its node)"
            )
        _, ended_s = self._end()
        silence = self.live.silence(
            rank, ended_s if ended_s is not None else self.live.seen_until_s(self.rank)
        )
        return f"; it {silence}" if silence else ""

    def incident(
        self, missing: Sequence[Incident], blame: Mapping[int, str], waiting: Sequence[int], graph: WaitGraph
    ) -> Incident:
        h, rank, wait = self.h, self.rank, self.wait
        pending = h.get("pending_buckets") or []
        starving = [b for b in pending if b.get("missing") and not b.get("launched")]
        params = [p for b in (starving or pending) for p in b.get("missing") or []]
        bucket = (starving or pending)[0]["index"] if pending else None
        site = main_site(h)
        state, ended_s = self._end()
        duration = self._duration_s(ended_s)

        where = self.where()
        phase = h.get("phase")
        msg = (
            f"Rank {rank} made no progress for {duration:.0f} s{f' in {where}' if where else ''} "
            f"at step {h.get('step')}, phase {phase}"
        )
        native = self.native
        if phase == "after_forward" and native is None:
            msg += f" ({AFTER_FORWARD}: the loss, or other code of its own)"
        if not wait and site:
            msg += f", {thread_words(h)} at {site}"
        if hooked := hook_wait(h):
            msg += f", {hooked}"
        if native is not None and native.place.startswith(RENDEZVOUS_PLACE):
            msg += f", blocked, waiting for the job's ranks: {native.what}"
        elif native is not None:
            msg += f", blocked in a collective ddpscope does not record: {native.what}"

        if exit_wait := _exit_wait(h, state == "active", duration):
            msg, culprits = exit_wait, [rank]
            return self._incident(h, msg, culprits, state, bucket, params, site)
        why = self._peers_at_wait()
        for inc in missing:
            if wait and inc.pg == wait["pg"] and rank not in inc.culprit_ranks:
                for r in inc.culprit_ranks:
                    why.setdefault(r, blame.get(r, "never entered this collective"))
        for r, reason in blame.items():
            if r != rank:
                why.setdefault(r, reason)
        if not why and in_set_up(native):
            why = self._came_late()
        why = _through_waits(why, blame, graph)
        why = through_past_waits(why, self.snapshot, self.live, self.colls, record_s(h), keep={rank, *blame})
        own = why.pop(rank, None)
        if why and own is not None:  # a deadlock that names this rank among others
            why[rank] = own
        culprits = sorted(why)
        others = [r for r in waiting if r != rank]
        if in_own_code(h):
            # Who waited for it while it was stuck, also once that is over (a checkpoint that ended).
            others = sorted(set(others) | set(waiters(self.snapshot, h)))
        if culprits:
            msg += "; culprit: " + "; ".join(f"rank {r} ({why[r]})" for r in culprits)
        elif not wait and not pending and native is None and others:
            culprits = [rank]
            cpu = main_blocked(h)
            debugger = debugger_wait(main_stack(h) or "")
            loader = waits_for_loader(h)
            said = how_stuck(
                blocked=cpu, waits_on=waits_on(h), debugger=debugger, loader=loader, workers=workers_words(h)
            )
            how = f"{said}, " if said else ""
            # A main thread that waits (not one computing) may wait for what a dead thread would have made.
            if (
                not debugger
                and not loader
                and cpu is not False
                and (dead := dead_thread_note(self.snapshot, rank, hang_start_s(h)))
            ):
                how += f"{dead.removeprefix(', ')}, "
            msg += (
                f"; it {'is' if state == 'active' else 'was'} stuck in its own code, {how}outside any collective, "
                f"while {ranks_phrase(others)} "
                + (("waits" if len(others) == 1 else "wait") if state == "active" else "waited")
                + " for it"
                + (
                    f" (it {blame[rank]})"
                    if rank in blame and not blame[rank].endswith(FROM_HANG_REPORT)
                    else ""
                )
                + _routine(self.snapshot, h, site)
            )
        elif rank in blame:
            culprits = [rank]
            msg += f"; this rank is at fault: it {blame[rank]}{self._own_wrapper_differs()}"
        elif starving:
            culprits = [rank]
            # Not unused parameters: those end the backward without them (torch's DDP goes on and fails
            # the next forward; ddpscope's engine raises at the end of this backward). A backward that
            # does not end is still computing the gradients these buckets wait for.
            msg += (
                f"; its backward has not finished: the gradients of {', '.join(params[:8])} (bucket {bucket}) "
                "are not computed yet, so its main thread is slow or stuck inside the backward pass "
                "(an autograd hook, a custom backward, an op that blocks: see the main thread's stack)"
            )
        elif wait and (tags := tags_differ(wait, self.rank, self.colls)) is not None:
            culprits, why_tags = tags
            msg += why_tags
        elif wait:
            msg += "; every rank issued this collective in time: the wait is inside the backend (network, or a peer stuck in native code)"
        elif (
            native is not None
            and native.place.startswith(GROUP_CONSTRUCTION_PLACE)
            and relaunched_before_start(self.snapshot, h)
        ):
            msg += f"{RESTART_HANG_CAUSE}{RESTART_ADVICE}"
        elif native is not None:
            msg += (
                "; no other rank's hang report places it elsewhere meanwhile: look for a rank that is slow, "
                "stopped or dead, or that skipped this call (its heartbeats, its log)"
            )
        else:
            msg += "; no collective is in flight: this rank is stuck in its own code (see the main thread's stack)"
        prefix = {
            "resolved": "(resolved) ",
            **{r: f"(ended when the rank was stopped by {name}) " for r, name in STOP_SIGNALS.items()},
            "died": "(ended when the rank died) ",
            "exited": "(ended when the rank exited) ",
            "lost": "(ended when the whole job fell silent) ",
        }.get(state, "")
        return self._incident(h, prefix + msg, culprits, state, bucket, params, site)

    def _incident(
        self,
        h: Record,
        msg: str,
        culprits: list[int],
        state: str,
        bucket: int | None,
        params: list[str],
        site: str | None,
    ) -> Incident:
        wait = self.wait
        return Incident(
            kind="hang",
            message=msg + ".",
            rank=self.rank,
            step=h.get("step"),
            seq=wait["coll_seq"] if wait else None,
            pg=wait["pg"] if wait else None,
            bucket=bucket,
            parameters=params,
            culprit_ranks=culprits,
            call_site=(wait.get("call_site") if wait else None) or site,
            stack=_stacks(h.get("stacks") or [], training_thread(h)),
            time_s=hang_start_s(h),
            active=state not in ("resolved", "exited"),
        )


def _routine(snapshot: JobSnapshot, h: Record, site: str | None) -> str:
    """The note for a stall in a rank's own code at a line where the same rank stalled before and went on
    each time (an evaluation or a checkpoint on one rank while the others wait, every epoch): a routine
    phase longer than the hang timeout, not a hang. '' the first time."""
    if site is None:
        return ""
    before = []
    for x in snapshot.hangs:
        if x is h or x["rank"] != h["rank"] or record_s(x) >= record_s(h) or main_site(x) != site:
            continue
        start, end = span_s(snapshot, x)
        if end != float("inf"):
            before.append(end - start)
    if not before:
        return ""
    went_on = (
        f"once before and went on after {before[0]:.0f} s"
        if len(before) == 1
        else f"{len(before)} times before and went on each time (after {max(before):.0f} s at most)"
    )
    return (
        f"; it stalled at this line {went_on}: "
        "a routine phase of this rank alone that outlasts DDPSCOPE_HANG_TIMEOUT while its peers wait (an "
        "evaluation or a checkpoint on one rank, then a collective), rather than a hang. Set "
        "DDPSCOPE_HANG_TIMEOUT above its length, or spread that work over every rank"
    )


def hook_wait(report: Record) -> str | None:
    """ "waiting for the future of bucket 0 from its comm hook, f() at train.py:12, which issued no
    collective" when a bucket of the report was launched through the user's comm hook and the hook issued
    nothing ddpscope saw (``records.PENDING_BUCKET``'s ``hook``): no peer can complete that future, so the
    wait is the hook's own doing (it skipped the all-reduce on this rank, or returned a future it never
    completes). None otherwise."""
    hooked = [b for b in report.get("pending_buckets") or [] if b.get("launched") and b.get("hook")]
    if not hooked:
        return None
    buckets = ", ".join(str(b["index"]) for b in hooked)
    return (
        f"waiting for the future of bucket{'s' if len(hooked) > 1 else ''} {buckets} from its comm hook, "
        f"{hooked[0]['hook']}, which issued no collective (the hook skipped the all-reduce on this rank, or "
        "returned a future nothing completes)"
    )


def _exit_wait(h: Record, active: bool, duration_s: float) -> str | None:
    """The sentence for a rank stuck on its way out (``agent/exit_wait.py``): its main thread waits in
    Python's exit for threads that are not daemons, or runs an exit handler that does not return; else None."""
    if not exiting(h):
        return None
    head = f"Rank {h['rank']} finished its script but {'cannot' if active else 'could not'} exit: its main thread "
    if not joining_threads(h):
        where = f" at {main_site(h)}" if main_site(h) else ""
        return (
            f"{head}{'has run' if active else 'ran'} an exit handler for {duration_s:.0f} s that never returned"
            f"{where}. {HANDLER_ADVICE}"
        )
    holders = [
        (str(s.get("thread")), user_frame(s.get("stack")))
        for s in h.get("stacks") or []
        if s.get("daemon") is False and not str(s.get("thread")).startswith(_OWN_THREADS)
    ]
    return (
        f"{head}{'has waited' if active else 'waited'} {duration_s:.0f} s in Python's shutdown for "
        f"{holders_phrase(holders)}, which never ended. {EXIT_ADVICE}"
    )


def tags_differ(wait: Record, rank: int, colls: CollectiveIndex) -> tuple[list[int], str] | None:
    """``(the pair, why)`` when ``rank`` waits (or waited, until it failed) in a send or receive while its
    peer, on the same channel, waited only in transfers the other way with other tags: a receive takes
    only a message sent with its tag, so both wait until the process group's timeout. Not when the peer
    was in one with this tag too (tagged transfers may pair out of order on purpose). The peer's
    transfers counted are those that overlapped this wait and did not complete."""
    direction = P2P_OPS.get(str(wait.get("op")))
    pair = p2p_pair(str(wait.get("pg")))
    if direction is None or pair is None or rank not in pair or wait.get("ok"):
        return None
    peer = pair[1] if pair[0] == rank else pair[0]
    began, ended = wait["start_ns"], wait.get("end_ns")
    theirs = [
        c
        for c in colls.by_pg.get(wait["pg"], {}).get(peer, {}).values()
        if P2P_OPS.get(str(c.get("op"))) not in (None, direction)
        and not c.get("ok")
        and (ended is None or c["start_ns"] <= ended)
        and (c.get("end_ns") is None or c["end_ns"] >= began)
    ]
    tag = wait.get("tag") or 0
    if not theirs or any((c.get("tag") or 0) == tag for c in theirs):
        return None
    other = theirs[0]
    return sorted(pair), (
        f"; the tags differ: rank {rank}'s {wait.get('op')} carries tag {tag}, and rank {peer} waits in "
        f"{describe(other)}{'' if other.get('tag') else ' (tag 0)'}. A receive takes only a message sent with its tag, "
        "so both wait until the process group's timeout: pass the same tag to the send and its receive (or "
        "none on either side: both default to 0)"
    )


def through_past_waits(
    why: Mapping[int, str],
    snapshot: JobSnapshot,
    live: Liveness,
    colls: CollectiveIndex,
    at_s: float,
    *,
    keep: set[int],
    depth: int = 8,
) -> dict[int, str]:
    """``why`` with each peer whose own hang report shows it blocked in a collective at ``at_s`` replaced
    by the peers *it* waited for there, and so on: the wait graph of a moment that is over (the live
    ``WaitGraph`` sees only hangs still active). A rank that entered its peers' collective late, or never,
    because it waited elsewhere itself (a slow set-up on one rank holds rank 0 in the clock sync, and
    rank 0 holds everyone else) is a victim. ``keep``: ranks never replaced (the asking rank, ranks an
    error names)."""
    out: dict[int, str] = {}
    for r, reason in why.items():
        report = None if r in keep or depth == 0 else _blocked_report(snapshot, r, at_s)
        theirs = None if report is None else _HangReading(report, snapshot, live, colls, {})
        held = {}
        if theirs is not None:
            # From a wait ddpscope does not record, only a peer stuck in its own code surely holds it up:
            # a peer blocked in another collective may be waiting for this very rank.
            peers = (
                theirs._peers_at_wait()
                if theirs.native is None
                else theirs._peers_elsewhere(blocked_too=False)
            )
            held = {q: w for q, w in peers.items() if q != r}
        where = None if theirs is None else theirs.where()
        if where is None or not held:
            out.setdefault(r, reason)
            continue
        deeper = through_past_waits(held, snapshot, live, colls, at_s, keep=keep | {r}, depth=depth - 1)
        for q, w in deeper.items():
            out.setdefault(q, f"{w}, holding up rank {r} in {where}, so that rank {r} {reason}")
    return out


def _blocked_report(snapshot: JobSnapshot, rank: int, at_s: float) -> Record | None:
    """``rank``'s latest hang report that shows it blocked in a collective (recorded or not) at ``at_s``:
    its stall had begun by then and was not resolved before."""
    best: Record | None = None
    for h in snapshot.hangs:
        if h["rank"] != rank or not (h.get("inflight") or native_wait(h)):
            continue
        start, resolved_s = span_s(snapshot, h)
        if not start <= at_s <= resolved_s:
            continue
        if best is None or record_s(h) > record_s(best):
            best = h
    return best


def _through_waits(why: Mapping[int, str], blame: Mapping[int, str], graph: WaitGraph) -> dict[int, str]:
    """``why`` with each peer that is itself blocked in a collective replaced by the ranks at the end of
    its chain of waits: a victim is never the culprit. (The chain may end at the hanging rank itself.)"""
    out: dict[int, str] = {}
    for r, reason in why.items():
        held = graph.waits.get(r)
        if held is None:
            out.setdefault(r, reason)
            continue
        for root, edge in graph.roots(r).items():
            if root == r or graph.cycle_of(root):  # a deadlock's rank: its reason says it all
                out.setdefault(root, blame.get(root, edge))
            else:
                out.setdefault(
                    root, f"{blame.get(root, edge)}; rank {r} waits on it, blocked in {held.where}"
                )
    return out


def _stacks(stacks: Sequence[Record], trainer: str = "MainThread") -> str | None:
    """The user's threads' stacks, the training thread (``trainer``) first; ddpscope's own threads are
    left out."""
    mine = [s for s in stacks if not str(s.get("thread", "")).startswith(_OWN_THREADS)]
    if not mine:
        return None
    ordered = sorted(mine, key=lambda s: s.get("thread") != trainer)
    return "\n\n".join(f"Thread {s.get('thread')}:\n{s.get('stack', '').rstrip()}" for s in ordered)
