"""Who waits for whom: the ranks blocked in collectives, and the ranks holding each of them up.

A rank blocked in collective #N of a process group waits for every member that has not issued #N
yet and, where the ranks disagree at #N (a mismatch), for the ranks that issued something else there.
Following these edges from a waiting rank ends at the ranks holding everyone up, its *roots*: ranks
that wait for nobody, because they are silent, dead, gone, stuck in their own code, busy elsewhere or
the odd one out of a mismatch (also while it waits in a later collective of that group: it went on
past the number where it issued something else). A rank in the middle of a chain is a victim however it looks from one
group: it "never issued" the collective its peers wait in only because it is blocked in another.

Edges that close into a cycle with no way out are a **deadlock**. Sequence numbers only grow within a
group, so such a cycle spans two groups or more: the ranks issue collectives on groups that share
ranks in a different order (a subgroup collective on one rank, while its peer has gone on to the
default group's next all-reduce). The rank at fault is the one blocked in a collective its peer has
never issued anything like; when that singles out nobody, every rank of the cycle is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ddpscope.server.analysis.collective_diagnosis import CollectiveIndex
from ddpscope.server.analysis.incident_model import (
    NEW_GROUP,
    Incident,
    Record,
    capitalized,
    describe,
    never_issued,
    ranks_phrase,
)
from ddpscope.server.analysis.status import Liveness


@dataclass(frozen=True, slots=True)
class Wait:
    """A rank blocked in a collective, and the peers it waits for (with why each holds it up)."""

    rank: int
    record: Record
    on: Mapping[int, str]

    @property
    def where(self) -> str:
        c = self.record
        return f"{describe(c)}, collective #{c['coll_seq']} of group {c['pg']}"


class WaitGraph:
    """The wait-for graph of a job at one moment. ``mismatched`` maps (group, sequence number) to the
    ranks a mismatch there blames: the others, blocked at that number, wait for them."""

    def __init__(
        self, colls: CollectiveIndex, live: Liveness, mismatched: Mapping[tuple[str, int], Sequence[int]]
    ) -> None:
        self.colls = colls
        self.mismatched = mismatched
        self.waits: dict[int, Wait] = {}
        self.blocked: dict[int, Record] = {}
        """Per rank, the oldest collective it is blocked in, whether or not it waits for anyone there."""
        for ranks in colls.waits.values():
            for rank, seqs in ranks.items():
                if rank in live.silent:
                    continue  # stopped or cut off: what it last waited in is stale, and it holds others up
                for record in seqs.values():
                    held = self.blocked.get(rank)
                    if held is None or record["start_ns"] < held["start_ns"]:
                        self.blocked[rank] = record
        # The odd one out of a mismatch is a root whatever it waits in later on that group: it went on
        # past the number where it issued something else, and its peers' "never issued" there is its doing.
        odd_since: dict[tuple[int, str], int] = {}
        for (pg, seq), odd_ranks in mismatched.items():
            for m in odd_ranks:
                odd_since[(m, pg)] = min(seq, odd_since.get((m, pg), seq))
        # A rank with several collectives in flight (the engine's async bucket all-reduces) is blocked
        # in the oldest: the later ones wait behind it, whoever else they lack.
        for rank, record in self.blocked.items():
            pg, seq = record["pg"], record["coll_seq"]
            if odd_since.get((rank, pg), seq) < seq:
                continue
            never = never_issued(pg, seq)
            on = {m: never for m in colls.behind(pg, seq, live) if m != rank}
            odd = mismatched.get((pg, seq), ())
            if rank not in odd:
                for m in odd:
                    on.setdefault(m, f"issued a different collective at #{seq} of group {pg}")
            if on:
                self.waits[rank] = Wait(rank, record, on)
        reach = {r: self._reachable(r) for r in self.waits}
        self.cycles: list[list[int]] = []
        """Closed cycles: each rank in one waits, through the others, only for ranks in it."""
        for r, reached in reach.items():
            # Sequence numbers only grow within a group: a cycle must cross groups to be a deadlock.
            if r in reached and all(reach.get(t) == reached for t in reached) and self._groups(reached) > 1:
                cycle = sorted(reached)
                if cycle not in self.cycles:
                    self.cycles.append(cycle)
        # Each hang and missing collective that runs into a cycle asks who is at fault in it.
        self._at_fault = [self._odd_ones(c) for c in self.cycles]

    def _groups(self, ranks: Iterable[int]) -> int:
        return len({self.waits[r].record["pg"] for r in ranks})

    def _reachable(self, rank: int) -> frozenset[int]:
        seen: set[int] = set()
        todo = list(self.waits[rank].on)
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            held = self.waits.get(r)
            if held is not None:
                todo.extend(held.on)
        return frozenset(seen)

    def state(self, rank: int) -> str | None:
        """ "it is blocked ..." for a rank blocked in a collective; None otherwise."""
        held = self.waits.get(rank)
        if held is not None:
            return f"it is blocked itself, in {held.where}, waiting for {ranks_phrase(held.on)}"
        c = self.blocked.get(rank)
        if c is None:
            return None
        odd = (c["pg"], c["coll_seq"]) in self.mismatched
        return f"it is blocked in {describe(c)}, collective #{c['coll_seq']} of group {c['pg']}" + (
            ", where the ranks disagree (see the mismatch)" if odd else ""
        )

    def cycle_of(self, rank: int) -> list[int] | None:
        return next((c for c in self.cycles if rank in c), None)

    def at_fault(self, cycle: Sequence[int]) -> list[int]:
        """The ranks of a deadlock (one of ``cycles``) at fault: see ``_odd_ones``."""
        return self._at_fault[self.cycles.index(list(cycle))]

    def _odd_ones(self, cycle: Sequence[int]) -> list[int]:
        """The ranks of a deadlock blocked in the call least like anything their peers of the cycle
        make: on a group a peer has never issued anything on, else a collective a peer has never issued
        on that group; every rank of the cycle when that singles out nobody."""
        odd = {r: self._oddity(r, [p for p in self.waits[r].on if p in cycle]) for r in cycle}
        worst = max(odd.values())
        culprits = [r for r in cycle if odd[r] == worst]
        return culprits if worst and len(culprits) < len(cycle) else list(cycle)

    def _oddity(self, rank: int, peers: Sequence[int]) -> int:
        """2: a peer never issued anything on the group ``rank`` waits in; 1: never this collective there."""
        c = self.waits[rank].record
        if any(not self.colls.issued_on(p, c["pg"]) for p in peers):
            return 2
        return 1 if any(not self.colls.issued_like(p, c) for p in peers) else 0

    def roots(self, rank: int) -> dict[int, str]:
        """The ranks at the end of ``rank``'s chain of waits, each with why it holds the chain up (the
        edge that reached it); ``{}`` when ``rank`` waits for nobody. Ranks of a deadlock the chain runs
        into count by ``at_fault``."""
        held = self.waits.get(rank)
        if held is None:
            return {}
        out: dict[int, str] = {}
        seen = {rank}
        todo = list(held.on.items())
        while todo:
            r, why = todo.pop(0)
            if r in seen:
                continue
            seen.add(r)
            cycle = self.cycle_of(r)
            if cycle is not None:
                for c in self.at_fault(cycle):
                    out.setdefault(c, f"deadlocked in {self.waits[c].where}")
                continue
            waits = self.waits.get(r)
            if waits is None:
                out.setdefault(r, why)
            else:
                todo.extend(waits.on.items())
        cycle = self.cycle_of(rank)
        if not out and cycle is not None:  # every wait led back to rank: it is on the cycle itself
            out = {c: f"deadlocked in {self.waits[c].where}" for c in self.at_fault(cycle)}
        return out

    def resolve(self, ranks: Iterable[int]) -> list[int]:
        """``ranks`` with every rank that is itself waiting replaced by the roots it waits for."""
        out: set[int] = set()
        for r in ranks:
            out.update(self.roots(r) if r in self.waits else (r,))
        return sorted(out)


def _created_out_of_order(graph: WaitGraph) -> int | None:
    """The default group's sequence number of a mismatch between ``new_group`` calls (the ranks created
    their groups in different orders), if any."""
    for pg, seq in sorted(graph.mismatched):
        if pg == "default" and any(
            c.get("op") == NEW_GROUP
            for c in (q.get(seq) for q in graph.colls.by_pg.get(pg, {}).values())
            if c
        ):
            return seq
    return None


def deadlock_incidents(graph: WaitGraph, blame: dict[int, str]) -> list[Incident]:
    """One ``mismatch`` per deadlock: the ranks issue collectives on groups they share in a different
    order (the design's mismatch of process groups), so each waits for another forever."""
    out = []
    for cycle in graph.cycles:
        culprits = graph.at_fault(cycle)
        waits = [graph.waits[r] for r in cycle]
        chain = "; ".join(
            f"rank {w.rank} waits in {w.where} for {ranks_phrase(p for p in w.on if p in cycle)}"
            for w in waits
        )
        msg = f"Deadlock across process groups: {chain}. {'Neither' if len(cycle) == 2 else 'None of them'} can go on"
        fix = "Issue the collectives of groups that share ranks in the same order on every rank."
        if len(culprits) < len(cycle):
            for c in culprits:
                w = graph.waits[c]
                peers = [p for p in w.on if p in cycle and not graph.colls.issued_like(p, w.record)]
                never = not any(graph.colls.issued_on(p, w.record["pg"]) for p in peers)
                such = "any collective" if never else "such a collective"
                site = f" at {w.record['call_site']}" if w.record.get("call_site") else ""
                its, it = ("its", "it") if len(peers) == 1 else ("their", "they")
                msg += (
                    f". {capitalized(ranks_phrase(peers))} {'has' if len(peers) == 1 else 'have'} never issued "
                    f"{such} on group {w.record['pg']}, so rank {c}'s call{site} is the one out of "
                    f"order: a collective only rank {c} makes (a rank-dependent branch), or one {its} peers "
                    f"would make only after the collective {it} {'is' if len(peers) == 1 else 'are'} blocked in"
                )
        else:
            groups = ", ".join(sorted({w.record["pg"] for w in waits}))
            created = _created_out_of_order(graph)
            if created is None:
                msg += f". The ranks issue collectives on groups {groups} in a different order"
            else:
                msg += (
                    f". The ranks created their groups in different orders (see the mismatch at collective "
                    f"#{created} of group default): torch pairs groups by the order of the new_group calls, so "
                    f"{groups} name different groups on different ranks"
                )
                fix = "Create the groups in the same order on every rank."
        msg += f". {fix}"
        first = graph.waits[culprits[0]]
        for c in culprits:
            w = graph.waits[c]
            blame.setdefault(
                c,
                f"waits in collective #{w.record['coll_seq']} of group {w.record['pg']} for "
                f"{ranks_phrase(p for p in w.on if p in cycle)}, blocked in turn on it in another group (a deadlock)",
            )
        sites = [graph.waits[c].record.get("call_site") for c in culprits]
        out.append(
            Incident(
                kind="mismatch",
                message=msg,
                rank=culprits[0],
                step=first.record.get("step"),
                seq=first.record["coll_seq"],
                pg=first.record["pg"],
                culprit_ranks=culprits,
                call_site=", ".join(dict.fromkeys(s for s in sites if s)) or None,
                # The deadlock closed when the last of its waits began.
                time_s=max(w.record["start_ns"] for w in waits) / 1e9,
            )
        )
    return out
