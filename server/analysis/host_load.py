"""Hosts with more compute threads than cores, from the ranks' ``rank_start`` records.

Where a host's ranks want more CPUs than it has, they share the cores, with their communication and agent
threads, and the sharing slows them unevenly: over a window of steps one rank can read as a straggler although
it would be no slower than its peers on cores of its own (seen in ``make demo``: 4 ranks of one thread on 2
cores, now and then a rank at 1.3x "mostly backward"). Such a straggler is real, the job waits for it, but its
remedy is the host's load, not the rank: so a straggler on such a host says so.

It is said from the host's numbers, not measured per rank: the main thread's run-queue wait
(``/proc/self/task/<tid>/schedstat``) was tried and told nothing. In five healthy 4-rank demo runs every rank
waited for a CPU 51-56 % of the time it could run, and the one rank flagged waited less than its peers and ran
less: its extra time was spent blocked (the GIL, gloo's threads), not queued for a core.

A rank wants ``min(threads, cpus_allowed)`` CPUs: its intra-op threads, at most the CPUs its affinity allows
(ranks pinned to a core each want one). A host is crowded when its ranks want more than ``host_cpus``. Agents
older than these fields say nothing, and neither does this. Other processes on the host (a data loader's
workers, another job) are not counted: what is said is a lower bound on the crowding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.server.analysis.stragglers import Straggler


@dataclass(frozen=True, slots=True)
class CrowdedHost:
    host: str
    ranks: tuple[int, ...]
    wanted: int
    """CPUs the host's ranks want in all (each its threads, at most its allowed CPUs)."""
    cpus: int
    """The host's CPUs."""

    def note(self) -> str:
        n = len(self.ranks)
        return (
            f"host {self.host} runs {n} rank{'s' if n != 1 else ''} wanting {self.wanted} CPUs on {self.cpus}: "
            "ranks that share cores are slowed unevenly by the sharing itself, so this one may be no slower than "
            "its peers on cores of its own; give each rank cores of its own (fewer ranks per host, or fewer "
            "threads per rank) before suspecting this rank"
        )


def crowded_hosts(starts: Iterable[Mapping[str, Any]]) -> dict[int, CrowdedHost]:
    """Rank -> its host, for each rank on a host whose ranks want more CPUs than it has. ``starts``: the ranks'
    latest ``rank_start`` records."""
    by_host: dict[str, list[Mapping[str, Any]]] = {}
    for start in starts:
        if start.get("host") and start.get("host_cpus") and start.get("threads"):
            by_host.setdefault(str(start["host"]), []).append(start)
    out: dict[int, CrowdedHost] = {}
    for host, ranks in by_host.items():
        wanted = sum(min(int(r["threads"]), int(r.get("cpus_allowed") or r["threads"])) for r in ranks)
        cpus = max(int(r["host_cpus"]) for r in ranks)
        if wanted > cpus:
            crowded = CrowdedHost(host, tuple(sorted(int(r["rank"]) for r in ranks)), wanted, cpus)
            out.update((rank, crowded) for rank in crowded.ranks)
    return out


def with_contention(found: Sequence[Straggler], starts: Iterable[Mapping[str, Any]]) -> list[Straggler]:
    """``found``, each flagged straggler on a crowded host carrying that host's note as ``contention``."""
    crowded = crowded_hosts(starts)
    for s in found:
        if s.flagged and s.rank in crowded:
            s.contention = crowded[s.rank].note()
    return list(found)
