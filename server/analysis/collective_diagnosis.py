"""Matching ranks collective by collective: mismatches and missing collectives.

Collectives are matched by (process group, sequence number): every rank numbers the collectives it
issues on a group from 1, so at #N every rank must have issued the same op, reduce op, shapes and
dtypes, and for a rooted op (broadcast, scatter, reduce, gather) the same root. See ``incidents`` for
the rules (call-site ordering bugs, tie-breaks, extra collectives).

A group's members are the ``group_ranks`` its records carry (every rank for the default group): a
member that never issued a collective on it is still a member that the others wait for.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from ddpscope.agent.records import COLLECTIVES_FROM_THREADS
from ddpscope.server.analysis.collective_keys import full_key, signature
from ddpscope.server.analysis.incident_model import (
    NEW_GROUP,
    P2P_OPS,
    ROOTED_OPS,
    STOP_SIGNALS,
    UNEVEN_DATA_ADVICE,
    Incident,
    Record,
    capitalized,
    describe,
    never_issued,
    ranks_phrase,
    where,
)
from ddpscope.server.analysis.mismatch_causes import (
    SAME_LINE,
    SAME_LINE_ROOT,
    same_line,
    same_line_advice,
    size_consequence,
    skipped_routine,
)
from ddpscope.server.analysis.native_wait import native_wait
from ddpscope.server.analysis.snapshot import JobSnapshot, RankSteps, p2p_pair
from ddpscope.server.analysis.status import Liveness
from ddpscope.server.analysis.stuck import main_site, stuck_outside

if TYPE_CHECKING:
    from ddpscope.server.analysis.wait_graph import WaitGraph


class CollectiveIndex:
    """Collectives by process group, rank and sequence number, plus what each rank is stuck in."""

    def __init__(self, snapshot: JobSnapshot, live: Liveness) -> None:
        self.by_pg: dict[str, dict[int, dict[int, Record]]] = {}
        self._behind: dict[tuple[str, int], list[int]] = {}
        self._entered: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.max_seq: dict[tuple[int, str], int] = {}
        """(rank, pg) -> highest seq it issued; 0 for a member of a group that issued none on it."""
        self.group_ranks: dict[str, list[int]] = {}
        """Non-default group -> its members, from the records' ``group_ranks`` (newer agents)."""
        self.completed: dict[str, int] = {}
        """pg -> highest seq that completed on some rank (point-to-point left out)."""
        max_seq, group_ranks, completed = self.max_seq, self.group_ranks, self.completed
        for c in snapshot.collectives:
            rank, pg, seq = c["rank"], c["pg"], c["coll_seq"]
            self.by_pg.setdefault(pg, {}).setdefault(rank, {})[seq] = c
            if seq > max_seq.get((rank, pg), 0):
                max_seq[(rank, pg)] = seq
            if pg not in group_ranks and c.get("group_ranks"):
                group_ranks[pg] = sorted(c["group_ranks"])
            if c.get("ok") and c.get("op") not in P2P_OPS and seq > completed.get(pg, 0):
                completed[pg] = seq
        # A member that never issued anything on its group must show up in it (with nothing issued):
        # readers that take a group's members from max_seq (the hang diagnosis) then see it too.
        for pg, ranks in group_ranks.items():
            for r in ranks:
                max_seq.setdefault((r, pg), 0)
        for r, hb in snapshot.heartbeats.items():
            self._saw(r, "default", int(hb.get("last_coll_seq") or 0))
        # A collective that completed on one rank was issued by every member of its group: records of
        # a stopped rank can lag (they leave the process in rounds), the peers' completions say more.
        members = [(r, pg) for (r, pg) in max_seq] + [(r, "default") for r in live.ranks]
        for r, pg in members:
            if completed.get(pg, 0) > max_seq.get((r, pg), 0):
                max_seq[(r, pg)] = completed[pg]
        # waits[pg][rank] = {seq: collective}: what each live rank is blocked in, from its own hang
        # report or from a collective in flight for longer than a rank may stay silent.
        self.waits: dict[str, dict[int, dict[int, Record]]] = {}
        for h in snapshot.hangs:
            for c in h.get("inflight") or []:
                self._saw(h["rank"], c["pg"], c["coll_seq"])
        # A hang that ended only when its rank was stopped or the job died still shows where the rank
        # was blocked at the end: the post-mortem reads the wait graph of that moment.
        blocked_at_end = {**live.hangs_at_death, **live.stopped_hangs, **live.active_hangs}
        for r, h in blocked_at_end.items():
            for c in h.get("inflight") or []:
                full = self.by_pg.get(c["pg"], {}).get(r, {}).get(c["coll_seq"], c)
                self.waits.setdefault(c["pg"], {}).setdefault(r, {})[c["coll_seq"]] = full
        dead = set(live.exits) | set(live.fatal) | set(live.crashed)
        stuck_before_ns = (live.now_s - live.silent_after_s) * 1e9
        for c in snapshot.collectives:
            if c.get("end_ns") is None and c["start_ns"] < stuck_before_ns and c["rank"] not in dead:
                self.waits.setdefault(c["pg"], {}).setdefault(c["rank"], {})[c["coll_seq"]] = c
        # A rank stopped by a signal while it waited: the wait at that moment is the post-mortem's.
        for r, c in live.stopped_waits.items():
            self.waits.setdefault(c["pg"], {}).setdefault(r, {})[c["coll_seq"]] = c

    def behind(self, pg: str, seq: int, live: Liveness) -> list[int]:
        """The members of ``pg`` that never issued #``seq``; kept per number, since a thousand ranks
        waiting in one collective all ask."""
        key = (pg, seq)
        found = self._behind.get(key)
        if found is None:
            found = [m for m in self.members(pg, live) if self.max_seq.get((m, pg), 0) < seq]
            self._behind[key] = found
        return found

    def entered(self, pg: str, seq: int) -> list[tuple[int, int]]:
        """(start_ns, rank) of every rank's record of #``seq`` of ``pg``, latest first (kept)."""
        key = (pg, seq)
        found = self._entered.get(key)
        if found is None:
            found = sorted(
                ((q[seq]["start_ns"], r) for r, q in self.by_pg.get(pg, {}).items() if seq in q), reverse=True
            )
            self._entered[key] = found
        return found

    def _saw(self, rank: int, pg: str, seq: int) -> None:
        self.max_seq[(rank, pg)] = max(self.max_seq.get((rank, pg), 0), seq)

    def members(self, pg: str, live: Liveness) -> list[int]:
        """The ranks of ``pg``: every rank for the default group; the pair a point-to-point channel is
        named after; else its recorded members, or, from agents that do not send them, the ranks seen
        issuing on it."""
        if pg == "default":
            return list(live.ranks)
        pair = p2p_pair(pg)
        if pair is not None:
            return list(pair)
        known = self.group_ranks.get(pg)
        if known is not None:
            return known
        return sorted({r for (r, p) in self.max_seq if p == pg})

    def last(self, rank: int, pg: str) -> Record | None:
        seqs = self.by_pg.get(pg, {}).get(rank, {})
        return seqs[max(seqs)] if seqs else None

    def issued_on(self, rank: int, pg: str) -> bool:
        """True when ``rank`` has a record of any collective on ``pg``."""
        return bool(self.by_pg.get(pg, {}).get(rank))

    def issued_like(self, rank: int, c: Record) -> bool:
        """True when ``rank`` issued, at any sequence number of ``c``'s group, the same collective as
        ``c`` (op, reduce op, shapes, dtypes; and call site where both records have one): a call it
        makes too, so a wait for it there is routine."""
        want, site = signature(c, root=False), c.get("call_site")
        return any(
            signature(x, root=False) == want
            and (not site or not x.get("call_site") or x["call_site"] == site)
            for x in self.by_pg.get(c["pg"], {}).get(rank, {}).values()
        )


QUIET_AFTER_S = 5.0
"""A rank quiet this long has missed two default heartbeats (2 s): not said to be alive any more."""


def _roots_comparable(recs: Mapping[int, Record]) -> bool:
    """True when every rank issued the same rooted op and named its root: roots can then be compared.
    (The point-to-point peer differs per rank by nature and is not a root: its pg names the pair.)"""
    ops = {c.get("op") for c in recs.values()}
    return len(ops) == 1 and ops.pop() in ROOTED_OPS and all(c.get("root") is not None for c in recs.values())


_COMPARED_FIELDS = ("op", "shapes", "dtypes", "reduce_op", "call_site", "source")
_compared = itemgetter(*_COMPARED_FIELDS)


def _disagreement(
    recs: Mapping[int, Record], sites: Callable[[], Mapping[int, set[str]]]
) -> tuple[str, dict[Any, list[int]]]:
    """('', {}) when ranks agree at one sequence number, else (reason, ranks grouped by what they did)."""
    # Fast path, the healthy case: every rank's record has the same fields as the first one's.
    try:
        values = [_compared(c) for c in recs.values()]
    except KeyError:  # a record without an optional field: take the slow path
        values = [tuple(c.get(f) for f in _COMPARED_FIELDS) for c in recs.values()]
    # When all these agree, only a rooted op can still disagree: on its root (each rank its own src);
    # and a point-to-point op, whose two peers must not agree (both calling recv at one line deadlocks).
    first_op = values[0][0]
    if (
        values.count(values[0]) == len(values)
        and first_op not in P2P_OPS
        and (first_op not in ROOTED_OPS or len({c.get("root") for c in recs.values()}) < 2)
    ):
        return "", {}
    with_root = _roots_comparable(recs)
    groups: dict[Any, list[int]] = {}
    for r, c in sorted(recs.items()):
        groups.setdefault(signature(c, with_root), []).append(r)
    if len(groups) > 1:
        differs = [
            n
            for n, i in (("ops", 0), ("reduce ops", 1), ("shapes", 2), ("dtypes", 3), ("roots", 4))
            if len({k[i] for k in groups}) > 1
        ]
        # Different ops differ in everything else too: saying so adds nothing.
        return "ops" if "ops" in differs else " and ".join(differs), groups
    sources = {c.get("source") for c in recs.values()}
    if "join" in sources:
        # torch's Join: a rank out of data shadows its peers' collectives (bucket all-reduces, the join
        # handshake) from other code by design; agreeing ops and shapes are all that can be asked.
        return "", {}
    if len(sources) > 1 and None not in sources:
        # The engine issues its all-reduces in lockstep on every rank; a user call paired with one of
        # them means the user call was made on some ranks only, even when the shapes happen to match.
        by_source: dict[Any, list[int]] = {}
        for r, c in sorted(recs.items()):
            by_source.setdefault(c.get("source"), []).append(r)
        return "source", by_source
    directions = [P2P_OPS.get(c.get("op", "")) for c in recs.values()]
    if all(directions):
        # Both peers sending (or both receiving) deadlocks; call sites of a pair differ by nature.
        if len(recs) == 2 and len(set(directions)) == 1:
            return "direction", {(c.get("op"), r): [r] for r, c in sorted(recs.items())}
        return "", {}
    call_sites = {c.get("call_site") for c in recs.values()}
    if len(call_sites) < 2 or None in call_sites:
        return "", {}
    # Same op and shapes from different lines: an ordering bug only if every rank runs both lines.
    used = sites()
    if not all(site in used.get(r, set()) for site in call_sites for r in recs):
        return "", {}
    by_site: dict[Any, list[int]] = {}
    for r, c in sorted(recs.items()):
        by_site.setdefault(c.get("call_site"), []).append(r)
    return "order", by_site


class _Lazy:
    """A value computed on the first call and kept."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make, self._value, self._done = make, None, False

    def __call__(self) -> Any:
        if not self._done:
            self._value, self._done = self._make(), True
        return self._value


def _sites_by_rank(ranks: Mapping[int, Mapping[int, Record]]) -> dict[int, set[str]]:
    return {r: {c["call_site"] for c in q.values() if c.get("call_site")} for r, q in ranks.items()}


def _keys_by_rank(ranks: Mapping[int, Mapping[int, Record]]) -> dict[int, set[tuple[Any, ...]]]:
    return {r: {full_key(c) for c in q.values()} for r, q in ranks.items()}


def mismatch_incidents(
    colls: CollectiveIndex, snapshot: JobSnapshot, blame: dict[int, str]
) -> list[Incident]:
    out = []
    for pg, ranks in sorted(colls.by_pg.items()):
        # Needed only once ranks disagree somewhere: built on first use.
        sites = _Lazy(partial(_sites_by_rank, ranks))
        keys = _Lazy(partial(_keys_by_rank, ranks))
        all_seqs = sorted({s for seqs in ranks.values() for s in seqs})
        found: tuple[int, str, dict[Any, list[int]], dict[int, Record]] | None = None
        first_calls: dict[int, tuple[Any, ...]] = {}
        repeats = others = 0
        for seq in all_seqs:
            recs = {r: seqs[seq] for r, seqs in ranks.items() if seq in seqs}
            if len(recs) < 2:
                continue
            reason, groups = _disagreement(recs, sites)
            if reason and found is None:
                found = (seq, reason, groups, recs)
                first_calls = {r: full_key(c) for r, c in recs.items()}
            elif reason and {r: full_key(c) for r, c in recs.items()} == first_calls:
                repeats += 1  # the same calls again (a loop runs them every step), not a shifted order
            elif reason:
                others += 1
        if found is None:
            continue
        later = Later(repeats, others)
        racing = _racing_ranks(snapshot, pg)
        if racing:
            seq, reason, _, recs = found
            out.append(_threads_race(pg, seq, reason, recs, racing, later, blame))
            continue
        out.append(
            _mismatch(
                pg,
                *found,
                later=later,
                ranks=ranks,
                keys=keys(),
                blame=blame,
                steps=snapshot.steps,
                starts=snapshot.ranks,
            )
        )
    return out


def _racing_ranks(snapshot: JobSnapshot, pg: str) -> list[int]:
    """Ranks that said they issue collectives on ``pg`` from two threads at once (their
    ``collectives_from_threads`` warning)."""
    return sorted(
        {w["rank"] for w in snapshot.warnings if w["code"] == COLLECTIVES_FROM_THREADS and w.get("pg") == pg}
    )


def _threads_race(
    pg: str,
    seq: int,
    reason: str,
    recs: Mapping[int, Record],
    racing: list[int],
    later: Later,
    blame: dict[int, str],
) -> Incident:
    """A mismatch on a group whose collectives come from two threads at once on some ranks: that race
    orders the calls, not one rank's code, so those ranks are the culprits, and the comparison's reading
    of one rank as the odd one ("left its training loop early", "skipped a call") would send the reader
    to the wrong code. Said as what it is: which calls met, what that does, and the fix."""
    issued = "; ".join(f"rank {r} issued {describe(c)}" for r, c in sorted(recs.items()))
    first, *others = sorted(recs)
    a = recs[first]
    b = recs[next((r for r in others if full_key(recs[r]) != full_key(a)), first)]
    if _sizes_differ(reason):
        consequence = size_consequence(a, b)
    elif "ops" in reason.split(" and "):
        consequence = (
            "different exchange patterns wait until the process group's timeout (or fail a size check)"
        )
    else:
        consequence = "gloo pairs them silently and the results are wrong"
    verb = "issues" if len(racing) == 1 else "issue"
    msg = (
        f"Two threads' collectives met at collective #{seq} of group {pg}: {issued}. The {reason} differ: "
        f"{consequence}{_later_too(later)}. The cause is a race, not one rank's code: {ranks_phrase(racing)} "
        f"{verb} collectives on this group from two threads at once (see the collectives_from_threads "
        "incident), so each rank's order depends on its threads' timing. Issue every collective of a group "
        "from one thread, or give the other thread a process group of its own (dist.new_group, created on "
        "every rank in the same order)"
    )
    for r in racing:
        blame[r] = "issued collectives on this group from two threads at once"
    site = next((c["call_site"] for _, c in sorted(recs.items()) if c.get("call_site")), None)
    return _mismatch_incident(pg, seq, recs, msg, racing, site)


def sync_schedule_incidents(
    colls: CollectiveIndex, blame: dict[int, str], mismatches: Sequence[Incident] = ()
) -> list[Incident]:
    """Ranks that reduce gradients after different numbers of steps (``no_sync`` accumulation counts
    that differ per rank): every engine all-reduce still pairs op for op, so nothing else sees it,
    but each averages a different number of micro-batches per rank (silently wrong gradients), and
    ranks that end with different numbers of syncs leave the others hanging.

    Seen in the engine's own collectives, which carry the step that issued them: between two of them,
    each rank's step moves on by as many steps as it ran in between. A constant offset between ranks
    (one rank counted an extra forward once) is harmless and not flagged; a change of offset is, when the
    ranks' usual intervals between syncs differ too (a one-off change with one interval everywhere is an
    extra forward on some rank, such as an evaluation with autograd on), and except across torch's ``Join``:
    a rank out of data shadows its peers' steps without counting them, so after an uneven epoch it numbers
    its steps behind theirs, by design."""
    out = []
    for pg, ranks in sorted(colls.by_pg.items()):
        shadowed = sorted({s for q in ranks.values() for s, c in q.items() if c.get("source") == "join"})
        engine = {
            r: {
                s: c["step"]
                for s, c in q.items()
                if c.get("source") == "engine" and isinstance(c.get("step"), int)
            }
            for r, q in ranks.items()
        }
        common = sorted(set.intersection(*(set(q) for q in engine.values()))) if len(engine) > 1 else []
        # Past the first number where the ranks' calls disagree (``mismatches``: mismatch_incidents' finding
        # on this group), the calls no longer pair: that mismatch is the finding (a setting that differs, a
        # skipped collective), not the steps its records carry.
        disagree = min((i.seq for i in mismatches if i.pg == pg and i.seq is not None), default=None)
        common = [s for s in common if disagree is None or s < disagree]
        for before, seq in zip(common, common[1:], strict=False):
            moved = {r: q[seq] - q[before] for r, q in engine.items()}
            if len(set(moved.values())) < 2 or bisect.bisect(shadowed, before) < bisect.bisect(shadowed, seq):
                continue
            every = {r: _sync_period(q) for r, q in engine.items()}
            groups: dict[int | None, list[int]] = {}
            for r in sorted(every):
                groups.setdefault(every[r], []).append(r)
            if len(groups) < 2:
                # Every rank syncs at one interval, and the offset moved once: a rank ran a forward
                # without a backward (an evaluation with autograd on), not another accumulation.
                break
            ref = max(groups.values(), key=lambda g: (len(g), -g[0]))
            culprits = sorted(r for r in engine if r not in ref)
            steps_at = ", ".join(f"rank {r} of its step {engine[r][seq]}" for r in sorted(engine))
            periods = "; ".join(
                f"{ranks_phrase(g)} {'syncs' if len(g) == 1 else 'sync'} every {p} steps"
                if p is not None
                else f"{ranks_phrase(g)} at no regular interval"
                for p, g in sorted(groups.items(), key=lambda kv: kv[1][0])
            )
            first = culprits[0] if culprits else ref[0]
            out.append(
                Incident(
                    kind="mismatch",
                    message=(
                        f"The ranks synchronize gradients after different numbers of steps: collective #{seq} "
                        f"of group {pg}, the DDP engine's gradient all-reduce, reduces the gradients of "
                        f"{steps_at} ({periods}). Every such all-reduce averages a different number of "
                        "micro-batches per rank, so the gradients are silently wrong; and where the ranks "
                        "end up with different numbers of syncs, the first to finish leaves the others "
                        "hanging. Use the same gradient accumulation on every rank: no_sync() for the same "
                        "micro-steps, the same batch count per rank."
                    ),
                    rank=culprits[0] if culprits else None,
                    step=engine[first][seq],
                    seq=seq,
                    pg=pg,
                    culprit_ranks=culprits,
                    time_s=min(ranks[r][seq]["start_ns"] for r in engine) / 1e9,
                )
            )
            for r in culprits:
                blame.setdefault(r, "synchronizes gradients after a different number of steps")
            break
    return out


def _sync_period(steps_by_seq: Mapping[int, int]) -> int | None:
    """The most common number of steps between consecutive synced steps of one rank, or None."""
    synced = sorted(set(steps_by_seq.values()))
    gaps = [b - a for a, b in zip(synced, synced[1:], strict=False)]
    if not gaps:
        return None
    counts = Counter(gaps)
    return max(counts, key=lambda g: (counts[g], -g))


def _mismatch(
    pg: str,
    seq: int,
    reason: str,
    groups: dict[Any, list[int]],
    recs: dict[int, Record],
    *,
    later: Later,
    ranks: Mapping[int, Mapping[int, Record]],
    keys: Mapping[int, set[tuple[Any, ...]]],
    blame: dict[int, str],
    steps: Mapping[int, RankSteps],
    starts: Mapping[int, Record],
) -> Incident:
    if reason == "direction":
        return _same_direction(pg, seq, recs, blame)
    handled = {r: str(c["signal"]) for r, c in recs.items() if c.get("signal")}
    if handled and len(handled) < len(recs):
        return _from_signal_handler(pg, seq, reason, recs, handled, blame, later)
    skip = skipped_routine(recs, ranks)
    site = same_line(recs, reason) if skip is None else None
    if site is not None:
        return _same_line(pg, seq, reason, groups, recs, site, blame, later)
    if skip is not None:
        # The engine's ranks went on to the next backward without a call every rank makes each step.
        ref, why = skip.issued, ""
    elif reason == "source":
        # The engine's side is right by construction: it runs the same schedule on every rank.
        ref, why = groups["engine"], ""
    else:
        ref, why = _reference(groups, recs, keys)
    culprits = sorted(r for members in groups.values() for r in members if r not in ref)
    c0, r0 = culprits[0], ref[0]
    crec, rrec = recs[c0], recs[r0]
    distinct: dict[tuple[Any, ...], int] = {}
    for r in culprits:
        distinct.setdefault(full_key(recs[r]), r)
    what = "; ".join(
        f"{ranks_phrase(r2 for r2 in culprits if full_key(recs[r2]) == k)} issued {describe(recs[r])}"
        for k, r in distinct.items()
    )
    msg = f"{what} where {ranks_phrase(ref)} issued {describe(rrec)} at collective #{seq} of group {pg}"
    loop = _loop_counts(c0, r0, seq, ranks) if skip is None else ""
    left = "" if loop else _left_loop(culprits, ref, recs, ranks, steps)
    if left:
        msg = f"{left}: {msg}"
    if loop:
        msg += f". {loop}"
    shift = _shift(ranks.get(c0, {}), ranks.get(r0, {}), seq)
    if shift:
        msg += f": {ranks_phrase([c0])} {shift}"
    if skip is not None:
        msg += f". {skip.sentence(culprits)}"
        if _sizes_differ(reason):
            msg += f". The {reason} differ: {size_consequence(crec, rrec)}"
    elif reason == "source":
        msg += (
            _inside_step(culprits, ref, recs)
            or ". One side is the DDP engine's own all-reduce: a collective in user code was issued on some ranks only"
        )
    elif crec.get("op") == NEW_GROUP and rrec.get("op") == NEW_GROUP:
        msg += (
            ". The ranks created their process groups in different orders: torch.distributed.new_group is called "
            "by every rank of the world, members or not, in the same order and with the same ranks, because torch "
            "tells groups apart by the order of these calls. "
            + (
                "Here the new groups' members differ, so each rank waits to connect a group its peers never "
                "create, until the process group's timeout"
                if "shapes" in reason
                else "Here both groups have the same ranks, so torch pairs one rank's group with the other's, and "
                "collectives issued on one meet those issued on the other"
            )
        )
    elif reason == "order":
        msg += ". Same-shaped collectives issued in a different order: gloo pairs them silently and every rank gets a wrong result"
    elif "ops" in reason.split(" and "):
        # Different collectives run different exchange patterns: observed on gloo, barrier against
        # all_reduce and all_gather against all_reduce both wait until the process group's timeout.
        msg += (
            f". The {reason} differ: the ranks run different exchange patterns, which waits until the "
            "process group's timeout (or fails on a size check) on gloo and NCCL alike"
        )
        differ = _wrapped_differently(recs, starts)
        if differ:
            msg += (
                f". Both are the DDP engine's own collectives, and the ranks wrapped the model with different "
                f"arguments ({differ}), so they issue different ones; wrap the same model with the same "
                "DistributedDataParallel arguments on every rank"
            )
    elif _sizes_differ(reason):
        msg += f". The {reason} differ: {size_consequence(crec, rrec)}"
        msg += _bucket_settings(recs, starts, keys)
    elif "roots" in reason:
        msg += f". The {reason} differ{_roots_consequence(crec)}"
    else:
        msg += f". The {reason} differ: gloo pairs them silently and the results are wrong"
    msg += _later_too(later)
    if reason != "source":
        msg += _inside_step(culprits, ref, recs)
    if left:
        msg += f". {UNEVEN_DATA_ADVICE}"
        for r in culprits:
            blame.setdefault(r, "stopped training early or issued a collective its peers skip")
    elif loop:
        msg += (
            ". A loop that issues a collective must run the same number of times on every rank: give every rank "
            "the same number of batches (DistributedSampler pads its shards to one length; or all_reduce the "
            "count and stop at the smallest), or gather the metrics once after the loop."
        )
        for r in culprits:
            blame.setdefault(
                r, f"ran a loop around a collective a different number of times at #{seq} of group {pg}"
            )
    else:
        msg += f". {why}Make every rank issue the same collectives in the same order."
    for r in culprits:
        blame.setdefault(
            r, skip.blame if skip is not None else f"issued a different collective at #{seq} of group {pg}"
        )
    sites = sorted({recs[r]["call_site"] for r in culprits if recs[r].get("call_site")})
    if skip is not None and skip.call.get("call_site"):
        sites = [skip.call["call_site"]]  # the line the culprits skipped: theirs is the engine's, no line
    return _mismatch_incident(pg, seq, recs, msg, culprits, ", ".join(sites) or None, (c0, *ref))


def _same_line(
    pg: str,
    seq: int,
    reason: str,
    groups: dict[Any, list[int]],
    recs: Mapping[int, Record],
    site: str,
    blame: dict[int, str],
    later: Later,
) -> Incident:
    """Every rank issued collective #seq from one line, with different shapes or dtypes: the line is at
    fault, and the minority (on a tie, the side ``_reference`` does not take) only the odd size out, not a
    rank that went astray."""
    ranks = sorted(recs)
    ref, tied = _reference(groups, recs, {})
    culprits = [r for r in ranks if r not in ref]
    calls = "; ".join(
        f"{ranks_phrase(members)}: {describe({**recs[members[0]], 'call_site': None})}"
        for members in sorted(groups.values())
    )
    first = recs[ranks[0]]
    other = next(recs[r] for r in ranks if full_key(recs[r]) != full_key(first))
    if reason == "roots":
        what, consequence = SAME_LINE_ROOT, _roots_consequence(first)
    else:
        what, consequence = SAME_LINE, f": {size_consequence(first, other)}"
    msg = (
        f"Every rank issued {first.get('op')} at {site} as collective #{seq} of group {pg} ({calls}): "
        f"{what}. The {reason} differ{consequence}"
    )
    msg += _later_too(later) + ". "
    if tied:
        # Named all the same, as every mismatch names one side: alerts and the hang's culprit need a rank.
        msg += (
            f"No majority tells an odd rank: {ranks_phrase(culprits)} named against {ranks_phrase(ref)}'s "
            "call, but the line is at fault on every rank. "
        )
    else:
        msg += f"{capitalized(ranks_phrase(culprits))} had the odd {reason}. "
    # Group ranks equal global ranks on the default group only; elsewhere "its own rank" is not checked.
    own_roots = pg == "default" and all(recs[r].get("root") == r for r in ranks)
    msg += same_line_advice(reason, own_roots)
    for r in culprits:
        blame.setdefault(r, f"issued {first.get('op')} at {site} with {reason} its peers did not use")
    return _mismatch_incident(pg, seq, recs, msg, culprits, site)


def _from_signal_handler(
    pg: str,
    seq: int,
    reason: str,
    recs: Mapping[int, Record],
    handled: Mapping[int, str],
    blame: dict[int, str],
    later: Later,
) -> Incident:
    """A mismatch whose odd side was called from a signal handler (the agent records the signal): a
    preemption handler that checkpoints with a collective. Whichever side the majority is on, the handler's
    ranks are at fault: the signal reached them at one point of their loop and their peers elsewhere, or
    not at all."""
    culprits = sorted(handled)
    others = sorted(r for r in recs if r not in handled)
    call, other = recs[culprits[0]], recs[others[0]]
    signals = " / ".join(sorted(set(handled.values())))
    its = "its" if len(culprits) == 1 else "their"
    steps = sorted({recs[r]["step"] for r in culprits if recs[r].get("step") is not None})
    where = f"inside step {', '.join(map(str, steps))}" if steps else "between two steps"
    if _sizes_differ(reason):
        consequence = size_consequence(call, other)
    elif "ops" in reason:
        consequence = "the ranks wait for each other until the process group's timeout"
    else:
        consequence = "gloo pairs them silently and the results are wrong"
    msg = (
        f"{capitalized(ranks_phrase(culprits))} issued {describe(call)} from {its} {signals} handler, where "
        f"{ranks_phrase(others)} issued {describe(other)}, at collective #{seq} of group {pg}{_later_too(later)}"
        f": {consequence}. Python runs a signal handler in the main thread wherever it is when the signal "
        f"arrives ({ranks_phrase(culprits)}: {where}), and a signal reaches the ranks at different moments or "
        "only some of them (one node's preemption), so a collective in a handler meets whatever its peers are "
        "doing. Let the handler only set a flag; at one point of the training loop, all-reduce the flag (MAX) "
        "on every rank and checkpoint or stop together once it is set."
    )
    for r in culprits:
        blame.setdefault(
            r, f"called {recs[r].get('op')} from its {handled[r]} handler at #{seq} of group {pg}"
        )
    return _mismatch_incident(pg, seq, recs, msg, culprits, call.get("call_site"))


def _roots_consequence(call: Record) -> str:
    """ " (src): the ranks disagree on which rank sends ..." for a rooted ``call`` whose roots differ."""
    arg = ROOTED_OPS.get(call.get("op") or "", "root")
    return (
        f" ({arg}): the ranks disagree on which rank {'sends' if arg == 'src' else 'receives'} the data, so "
        "they wait for each other until the process group's timeout on gloo (where it completes, a rank gets "
        "the wrong rank's data)"
    )


def _mismatch_incident(
    pg: str,
    seq: int,
    recs: Mapping[int, Record],
    msg: str,
    culprits: list[int],
    call_site: str | None,
    step_from: Sequence[int] = (),
) -> Incident:
    """The ``mismatch`` incident at #``seq`` of ``pg``: its step is the first one a record carries, asked of
    the ranks in ``step_from`` first (a user call between steps carries none; the engine's always does)."""
    step = next(
        (recs[r]["step"] for r in (*step_from, *sorted(recs)) if recs[r].get("step") is not None), None
    )
    return Incident(
        kind="mismatch",
        message=msg,
        rank=culprits[0],
        step=step,
        seq=seq,
        pg=pg,
        culprit_ranks=culprits,
        call_site=call_site,
        time_s=min(recs[r]["start_ns"] for r in recs) / 1e9,
    )


@dataclass(frozen=True, slots=True)
class Later:
    """The disagreements that follow a mismatch at the same group."""

    repeats: int = 0
    """The same calls disagreeing again: the line runs again (every step), each time wrong."""
    others: int = 0
    """Other calls that disagree: the consequence of the first (a shifted order)."""


def _later_too(later: Later) -> str:
    """The note on the disagreements that follow a mismatch at the same group ('' when none do)."""
    again = f"the same calls disagree {_times(later.repeats)} more later" if later.repeats else ""
    n = later.others
    if not n:
        return f" ({again})" if again else ""
    others = f"{n} {'other ' if again else 'later '}collective{'s of this group disagree' if n > 1 else ' of this group disagrees'} too, as a consequence"
    return f" ({again}, and {others})" if again else f" ({others})"


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _sizes_differ(reason: str) -> bool:
    """The ranks' calls move different amounts of data (``_disagreement``'s reasons name shapes or dtypes)."""
    return "shapes" in reason or "dtypes" in reason


def _same_direction(pg: str, seq: int, recs: Mapping[int, Record], blame: dict[int, str]) -> Incident:
    """Both peers of a point-to-point transfer sending, or both receiving: neither call is the odd one,
    the pair's order is the bug, so both ranks are named."""
    ranks = sorted(recs)
    receiving = P2P_OPS.get(recs[ranks[0]].get("op") or "") == "recv"
    calls = "; ".join(f"rank {r}: {describe(recs[r])}" for r in ranks)
    msg = (
        f"{capitalized(ranks_phrase(ranks))} both {'receive from' if receiving else 'send to'} each other "
        f"as transfer #{seq} of group {pg} ({calls}): both peers issued the same direction, and "
        + (
            "a recv waits for its peer's send, so each waits for the other forever (a point-to-point deadlock)"
            if receiving
            else "a send waits for its peer's recv, so both block (gloo may complete small sends into its "
            "buffers; the transfers after it then pair up wrongly)"
        )
        + ". Order the pair so that one side sends while the other receives (for example even ranks send "
        "first and odd ranks receive first), or post both directions with isend/irecv "
        "(torch.distributed.batch_isend_irecv) and wait for both."
    )
    for r in ranks:
        blame.setdefault(r, f"issued the same point-to-point direction as its peer at #{seq} of group {pg}")
    sites = sorted({recs[r]["call_site"] for r in ranks if recs[r].get("call_site")})
    return _mismatch_incident(pg, seq, recs, msg, ranks, ", ".join(sites) or None)


def _bucket_settings(
    recs: Mapping[int, Record], starts: Mapping[int, Record], keys: Mapping[int, set[tuple[Any, ...]]]
) -> str:
    """When both sides are the DDP engine's own bucket all-reduces: either every rank has issued each
    side's bucket before (the same buckets, of one model or of several, taken in another order: a
    backward skipped or added on some ranks), or the buckets differ between ranks: say which
    construction arguments of theirs differ (from their ``rank_start``). '' when a side is not the engine's."""
    if not all(c.get("source") == "engine" for c in recs.values()):
        return ""
    if all(full_key(c) in keys.get(r, set()) for c in recs.values() for r in recs):
        return (
            ". Both are the DDP engine's bucket all-reduces, and every rank has issued both before: the same "
            "buckets (of one model, or of several models wrapped in DistributedDataParallel) taken in another "
            "order, not different buckets. Some ranks skipped or added a backward through one of them (a loss "
            "backpropagated on some ranks only, a `continue` before backward(), a model whose forward runs on "
            "some ranks only); run the same forward and backward passes on every rank"
        )
    differ = _wrapped_differently(recs, starts)
    what = f": {differ}" if differ else " (the same model wrapped the same way gives the same buckets)"
    return (
        f". Both are the DDP engine's bucket all-reduces, so the ranks built different buckets{what}; "
        "wrap the same model with the same DistributedDataParallel arguments on every rank"
    )


def _wrapped_differently(recs: Mapping[int, Record], starts: Mapping[int, Record]) -> str:
    """ "find_unused_parameters is True on rank 0, False on rank 1" for the DDP arguments that decide which
    collectives the engine issues and differ between the ranks of ``recs``, when every call in ``recs`` is
    the engine's own; '' otherwise."""
    if not all(c.get("source") == "engine" for c in recs.values()):
        return ""
    differ = []
    for key in ("bucket_cap_mb", "find_unused_parameters"):
        values = {r: starts.get(r, {}).get(key) for r in recs}
        if len(set(values.values())) > 1:
            differ.append(f"{key} is " + ", ".join(f"{v} on rank {r}" for r, v in sorted(values.items())))
    return "; ".join(differ)


def _inside_step(culprits: list[int], ref: list[int], recs: Mapping[int, Record]) -> str:
    """ ". Rank 1 made that call inside its step 2 ..." when the culprits' user calls, met by the engine's
    collective on the other ranks, carry the step they were made in (a call in a module's forward, a loss
    function or a backward hook, on some ranks only); '' otherwise."""
    calls = [recs[r] for r in culprits]
    steps = {c.get("step") for c in calls}
    if not all(c.get("source") == "user" for c in calls) or None in steps or len(steps) != 1:
        return ""
    if not all(recs[r].get("source") == "engine" for r in ref):
        return ""
    its = "its" if len(culprits) == 1 else "their"
    return (
        f". {capitalized(ranks_phrase(culprits))} made that call inside {its} step {steps.pop()} (in the model's "
        f"forward, the loss, or a hook backward runs), where {ranks_phrase(ref)} went on to DDP's gradient "
        "all-reduce: a collective in code the step runs on some ranks only (a rank-dependent branch, a "
        "debugging or logging call on one rank)"
    )


def _loop_counts(c0: int, r0: int, seq: int, ranks: Mapping[int, Mapping[int, Record]]) -> str:
    """ "Rank 1 made its call at eval.py:15 4 times in a row up to here, rank 0 3 times ..." when one side's call at ``seq``
    repeats a user call the other side issued just before and then stopped issuing: a loop around that
    call (an evaluation over a rank's own shard, a metric per batch) ran more times on one side. '' when
    neither side continues the other's run."""
    mine, theirs = ranks.get(c0, {}), ranks.get(r0, {})

    def run(records: Mapping[int, Record], key: tuple[Any, ...], last: int) -> int:
        n = 0
        while last - n in records and full_key(records[last - n]) == key:
            n += 1
        return n

    for longer, shorter, more in ((mine, theirs, c0), (theirs, mine, r0)):
        call = longer.get(seq)
        before = shorter.get(seq - 1)
        if call is None or before is None or call.get("source") != "user":
            continue
        key = full_key(call)
        if full_key(before) != key or key == full_key(shorter.get(seq, {})):
            continue
        fewer = r0 if more == c0 else c0
        n_more, n_fewer = run(longer, key, seq), run(shorter, key, seq - 1)
        site = f" at {call['call_site']}" if call.get("call_site") else ""
        return (
            f"Rank {more} made its call{site} {n_more} times in a row up to here, rank {fewer} {n_fewer} times "
            f"before going on: a loop around that call ran more iterations on rank {more} (an evaluation or "
            "metric loop over a shard of its own, a batch count that differs per rank)"
        )
    return ""


def _left_loop(
    culprits: list[int],
    ref: list[int],
    recs: Mapping[int, Record],
    ranks: Mapping[int, Mapping[int, Record]],
    steps: Mapping[int, RankSteps],
) -> str:
    """ "Rank 1 left its training loop after step 7 ..." when the culprits' side of a mismatch is a user
    collective issued after their last step, with nothing of the engine after it, where the reference
    ranks issued the engine's own bucket all-reduce of a step the culprits never ran: they ran out of
    batches (or broke out of the loop) and reached the collective at the end of their script while
    their peers went on training. '' otherwise."""
    if not all(recs[r].get("source") == "engine" for r in ref):
        return ""
    if any(recs[r].get("step") is not None for r in culprits):
        return ""  # made inside a step (``_inside_step``): the rank was still training
    peer_step = recs[ref[0]].get("step")
    lasts = []
    for r in culprits:
        c, done = recs[r], steps.get(r)
        trained_on = any(
            s > c["coll_seq"] and x.get("source") == "engine" for s, x in ranks.get(r, {}).items()
        )
        if c.get("source") != "user" or done is None or trained_on:
            return ""
        if c["start_ns"] < done.last_step_end_ns or (peer_step is not None and done.last_step >= peer_step):
            return ""
        lasts.append(done.last_step)
    who = ranks_phrase(culprits)
    after = (
        f"after step {max(lasts)}" if len(set(lasts)) == 1 else "after steps " + ", ".join(map(str, lasts))
    )
    in_step = f"step {peer_step}'s" if peer_step is not None else "the next step's"
    its, it = ("its", "it") if len(culprits) == 1 else ("their", "they")
    # The records cannot tell a collective after the loop from one inside it that only these ranks
    # reach: both stop the engine's collectives there. Say both rather than guess.
    return (
        f"{capitalized(who)} stopped training {after} and called a collective while {ranks_phrase(ref)} "
        f"{'was' if len(ref) == 1 else 'were'} in {in_step} bucket all-reduce: either {who} left {its} "
        f"training loop early (fewer batches than {its} peers, or a rank-dependent break) or {it} issued, "
        f"inside the loop, a collective {its} peers skip (a rank-dependent branch)"
    )


def _step_ahead(top: list[list[int]], recs: Mapping[int, Record]) -> tuple[list[int], str] | None:
    """On a tie, the side at the lower step as the reference, when each side's calls carry one step and
    only one side is at the lowest: step numbers count forwards with gradients on, and until this number
    the ranks' collectives paired, so the ranks ahead ran a forward their peers did not (an evaluation
    through the DDP model on those ranks only, without torch.no_grad()) and its collectives (the buffer
    broadcast) paired with their peers' next ones. None otherwise."""
    steps: list[int] = []
    for g in top:
        step = recs[g[0]].get("step")
        if step is None or any(recs[r].get("step") != step for r in g):
            return None
        steps.append(step)
    low = min(steps)
    if steps.count(low) != 1:
        return None
    ref = top[steps.index(low)]
    ahead = sorted(r for g, st in zip(top, steps, strict=True) if st != low for r in g)
    were = "was" if len(ahead) == 1 else "were"
    return ref, (
        f"The ranks split evenly, but {ranks_phrase(ahead)} {were} ahead (at step {max(steps)} against {low}): "
        f"step numbers count forwards with gradients on, so {ranks_phrase(ahead)} ran a forward through the DDP "
        f"model that {ranks_phrase(ref)} did not (an evaluation on some ranks only, without torch.no_grad()?), "
        "and its collectives (a buffer broadcast) paired with the others' next ones. "
    )


def _reference(
    groups: dict[Any, list[int]], recs: Mapping[int, Record], keys: Mapping[int, set[tuple[Any, ...]]]
) -> tuple[list[int], str]:
    """The ranks taken as doing the right thing, and a sentence explaining the choice on a tie."""
    size = max(len(g) for g in groups.values())
    top = [g for g in groups.values() if len(g) == size]
    if len(top) == 1:
        return top[0], ""

    def familiar(g: list[int]) -> bool:
        key = full_key(recs[g[0]])
        return all(key in keys.get(r, set()) for r in recs if r not in g)

    known = [g for g in top if familiar(g)]
    if len(known) == 1:
        return known[0], "The ranks split evenly; the odd call is the one the other ranks never make. "
    if ahead := _step_ahead(top, recs):
        return ahead
    ref = min(top, key=min)
    return ref, f"The ranks split evenly; {ranks_phrase(ref)}'s call is taken as the reference. "


def _shift(culprit: Mapping[int, Record], ref: Mapping[int, Record], seq: int) -> str:
    """How the culprit's sequence relates to the reference's around ``seq`` (extra, skipped, swapped)."""

    def key(seqs: Mapping[int, Record], s: int) -> tuple[Any, ...] | None:
        return full_key(seqs[s]) if s in seqs else None

    ahead = key(culprit, seq + 1) is not None and key(culprit, seq + 1) == key(ref, seq)
    behind = key(culprit, seq) is not None and key(culprit, seq) == key(ref, seq + 1)
    if ahead and behind:
        return "issued the same two collectives in the opposite order"
    if ahead:
        return "issued an extra collective here; its later ones are shifted by one"
    if behind:
        return f"skipped the collective the others issued at #{seq}; its later ones are shifted by one"
    return ""


def missing_incidents(
    colls: CollectiveIndex, live: Liveness, snapshot: JobSnapshot, blame: dict[int, str], graph: WaitGraph
) -> list[Incident]:
    out = []
    for pg, waiting in sorted(colls.waits.items()):
        for seq in sorted({s for seqs in waiting.values() for s in seqs}):
            missing = colls.behind(pg, seq, live)
            # A rank waits in #seq only if nothing older blocks it: a later async all-reduce in flight
            # behind its blocking collective says nothing of its own.
            waiters = sorted(
                r for r, seqs in waiting.items() if seq in seqs and _blocking(graph.blocked.get(r), pg, seq)
            )
            if not missing or not waiters:
                continue
            if all(graph.cycle_of(r) for r in waiters):
                continue  # a deadlock's own wait: its incident tells the whole cycle
            out.append(_missing(pg, seq, waiters, missing, waiting, colls, live, snapshot, blame, graph))
            break
    return out


def _blocking(blocked: Record | None, pg: str, seq: int) -> bool:
    return blocked is None or (blocked["pg"], blocked["coll_seq"]) == (pg, seq)


def _missing(
    pg: str,
    seq: int,
    waiters: list[int],
    missing: list[int],
    waiting: Mapping[int, Mapping[int, Record]],
    colls: CollectiveIndex,
    live: Liveness,
    snapshot: JobSnapshot,
    blame: dict[int, str],
    graph: WaitGraph,
) -> Incident:
    wait = waiting[waiters[0]][seq]
    end_s = max(live.seen_until_s(r) for r in waiters)
    since = end_s - min(waiting[r][seq]["start_ns"] for r in waiters) / 1e9
    stuck = stuck_outside(snapshot)
    msg = (
        f"{capitalized(ranks_phrase(waiters))} {_waited(waiters, live)} {since:.0f} s in "
        f"{describe(wait)}, collective #{seq} of group {pg}{_until_stopped(waiters, live)}; "
        f"{ranks_phrase(missing)} never issued it"
    )
    details = []
    for r in missing:
        last = colls.last(r, pg)
        state = (
            graph.state(r)  # blocked elsewhere until it was stopped: where matters more than how it ended
            if r in live.stopped_hangs and r in graph.blocked
            else _silent_when_stopped(r, live)
            if r in live.stopped_silent
            else f"{stuck[r].phrase()}, until {_exited(live.exits[r])}"
            if r in live.exits and r in stuck
            else _exited(live.exits[r])
            if r in live.exits
            else "it died"
            if r in live.fatal or r in live.crashed
            else "it is silent"
            if r in live.silent
            else "every rank fell quiet since"
            if live.lost
            else graph.state(r)
            if r in graph.blocked
            else stuck[r].phrase()
            if r in stuck
            else _blocked_unrecorded(live.active_hangs.get(r))
            or _quiet_or_alive(live.age_s(r), live.silent_after_s)
        )
        lst = (
            f"last collective #{last['coll_seq']} {describe(last)}"
            if last
            else f"no collective recorded in group {pg}"
        )
        done = colls.max_seq.get((r, pg), 0)
        if done > (last["coll_seq"] if last else 0):
            lst += f" (its peers completed #{done} with it; its own newer records never arrived)"
        details.append(f"rank {r}: {lst}; {state}{where(snapshot, r)}")
    # A missing rank blocked in another collective is a victim: what holds the waiters up is what
    # holds it up, at the end of its chain of waits.
    culprits = graph.resolve(missing)
    for r in culprits:
        if r not in graph.waits:
            blame.setdefault(r, never_issued(pg, seq))
    msg += " (" + "; ".join(details) + ")"
    odd_at = [
        s for (p, s), odd in graph.mismatched.items() if p == pg and s < seq and set(culprits) <= set(odd)
    ]
    if culprits and set(culprits) <= set(waiters) and odd_at:
        # The waiters went on past a mismatch of their own doing (wait_graph: the odd one is a root).
        one = len(culprits) == 1
        msg += (
            f". {capitalized(ranks_phrase(culprits))} {'waits' if one else 'wait'} for what {'it' if one else 'they'} "
            f"caused: {'it' if one else 'they'} issued a different collective at #{min(odd_at)} of group {pg} (see "
            "the mismatch incident) and went on to this one"
        )
    elif culprits != sorted(missing):
        holds = "holds" if len(culprits) == 1 else "hold"
        msg += f". {capitalized(ranks_phrase(culprits))} {holds} them all up (see {'its' if len(culprits) == 1 else 'their'} incidents)"
    elif any(graph.cycle_of(r) for r in missing):
        msg += ". The ranks are deadlocked across process groups (see the mismatch incident)"
    elif advice := _native_advice(missing, live):
        msg += f". {capitalized(advice)}"
    elif all(_never_got_there(r, live) for r in missing):
        one = len(missing) == 1
        msg += (
            f". {capitalized(ranks_phrase(missing))} did not skip this call: {'it' if one else 'they'} went "
            f"silent or died before reaching it (see {'its' if one else 'their'} incidents)"
        )
    else:
        msg += ". Find why those ranks skip this call (a rank-dependent branch, an early exit, a stuck data loader)"
    msg += "."
    last_culprit = colls.last(missing[0], pg)
    sites = [s for s in (wait.get("call_site"), last_culprit.get("call_site") if last_culprit else None) if s]
    return Incident(
        kind="missing_collective",
        message=msg,
        rank=waiters[0],
        step=wait.get("step"),
        seq=seq,
        pg=pg,
        culprit_ranks=culprits,
        call_site=", ".join(dict.fromkeys(sites)) or None,
        time_s=wait["start_ns"] / 1e9,
    )


def _waited(waiters: list[int], live: Liveness) -> str:
    if all(r in live.stopped_waits for r in waiters):
        return "waited"  # over: a signal stopped them there
    return "has waited" if len(waiters) == 1 else "have waited"


def _until_stopped(waiters: list[int], live: Liveness) -> str:
    """ " until it was stopped by SIGTERM" when a signal ended every waiter's wait (the job was cancelled
    while it waited); else nothing."""
    reasons = {str(live.exits[r].get("reason")) for r in waiters if r in live.stopped_waits}
    if len(reasons) != 1 or not all(r in live.stopped_waits for r in waiters):
        return ""
    who = "it was" if len(waiters) == 1 else "they were"
    return f", until {who} stopped by {STOP_SIGNALS[reasons.pop()]}"


def _blocked_unrecorded(hang: Record | None) -> str | None:
    """ "it is blocked in torch's backward pass ..." for a rank whose hang report shows it waiting in a
    collective ddpscope does not record (``native_wait``)."""
    there = native_wait(hang) if hang is not None else None
    if there is None or hang is None:
        return None
    at = f" at {site}" if (site := main_site(hang)) else ""
    return f"it is blocked in {there.place}{at}, in a collective ddpscope does not record (its hang report)"


def _never_got_there(r: int, live: Liveness) -> bool:
    """A missing rank that went silent (stopped, frozen) or died: no branch of its code skipped the call."""
    return r in live.silent or r in live.stopped_silent or r in live.crashed or r in live.fatal


def _native_advice(missing: list[int], live: Liveness) -> str | None:
    """The advice of the unrecorded wait every missing rank is blocked in, when that wait has its own (a
    rank still in DistributedDataParallel's state broadcast its peers left: models that differ)."""
    waits = [native_wait(h) if (h := live.active_hangs.get(r)) is not None else None for r in missing]
    advice = {w.advice if w is not None else None for w in waits}
    return advice.pop() if len(advice) == 1 else None


def _quiet_or_alive(age_s: float | None, silent_after_s: float) -> str:
    """A missing rank that is neither stuck, blocked, exited nor silent yet: alive, unless it has missed
    a heartbeat or two already (a SIGSTOP reads as alive until it is ``silent_after_s`` quiet)."""
    if age_s is not None and age_s > QUIET_AFTER_S:
        return (
            f"it has sent nothing for {age_s:.0f} s, heartbeats included (called silent after "
            f"{silent_after_s:.0f} s): stopped, frozen or cut off, or its records are late"
        )
    return "it is alive, doing something else"


def _silent_when_stopped(r: int, live: Liveness) -> str:
    """A missing rank that had sent nothing, heartbeats included, for ``silent_after_s`` when it (or, if it
    never said, its peers) was stopped (``Liveness.stopped_silent``): how it ended is not what matters."""
    exit_ = live.exits.get(r)
    quiet_s = (live.stopped_at_s(r) or live.now_s) - live.stopped_silent[r]
    how = f"it was stopped ({exit_.get('reason')})" if exit_ is not None else "its peers were stopped"
    return f"it had sent nothing for {quiet_s:.0f} s, heartbeats included, when {how} (see its rank_silent)"


def _exited(rank_exit: Record) -> str:
    """How a rank ended, from its ``rank_exit`` (whose step is None when the agent could not tell)."""
    step = rank_exit.get("step")
    return f"it exited ({rank_exit.get('reason')})" + (f" at step {step}" if step is not None else "")
