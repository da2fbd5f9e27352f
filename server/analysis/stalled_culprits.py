"""Where a blamed rank was: its own stall, as its watchdog sampled it, when a peer gave up on it.

A rank that holds its peers up in its own code (a checkpoint write, a slow read, a sleep) waits in no
collective, so nothing it recorded says where it is. Its hang report would (every thread's stack), but
only after ``DDPSCOPE_HANG_TIMEOUT`` (300 s by default): a peer whose collective times out first (a process
group's shorter timeout, ``monitored_barrier``'s) fails, the job ends, and the blamed rank never reported.
Its watchdog's ``stall_sample`` records (0.5 s into such a stall and at each doubling) still say where it
was. ``note_stalled_culprits`` appends that to each incident that blames a rank other than its own while
that rank was in a stall of its own: "Rank 1 was then 5.0 s into a stall of its own after step 7, at
monbar.py:11, blocked".
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpscope.agent.torch_waits import blocked
from ddpscope.server.analysis.incident_model import Incident, Record
from ddpscope.server.analysis.snapshot import JobSnapshot
from ddpscope.server.analysis.stalls import HOW
from ddpscope.server.analysis.stuck import stack_waits_for_loader

NOTED_KINDS = frozenset({"rank_error", "hang", "missing_collective", "mismatch", "rank_exited_early"})
"""Incidents that blame a rank for what another one waited on."""
TICK_S = 0.25
"""How late a sample may be taken (the watchdog's longest tick)."""


def note_stalled_culprits(incidents: Sequence[Incident], snapshot: JobSnapshot) -> None:
    """Append to each incident of ``NOTED_KINDS`` whose culprit (not its own rank) was in a stall of its own
    at the incident's time where that rank's main thread was, from its stall samples."""
    if not snapshot.stall_samples:
        return
    by_rank: dict[int, list[Record]] = {}
    for x in snapshot.stall_samples:
        by_rank.setdefault(int(x["rank"]), []).append(x)
    for inc in incidents:
        if inc.kind not in NOTED_KINDS or inc.time_s is None:
            continue
        for culprit in inc.culprit_ranks:
            if culprit == inc.rank or culprit not in by_rank:
                continue
            sample = stall_at(by_rank[culprit], snapshot, culprit, inc.time_s)
            if sample is not None and not _hang_reported(snapshot, culprit, sample):
                inc.message += stall_sentence(culprit, sample, inc.time_s)


def _hang_reported(snapshot: JobSnapshot, rank: int, sample: Record) -> bool:
    """Whether ``rank`` sent a hang report of the stall ``sample`` is of: that report (every thread's stack)
    already says where the rank was, and the incident cites it; the sample would say it twice."""
    began_s = sample["time_ns"] / 1e9 - float(sample["stalled_s"])
    return any(
        h["rank"] == rank and abs(h["time_ns"] / 1e9 - float(h["stalled_s"]) - began_s) <= 2 * TICK_S
        for h in snapshot.hangs
    )


def stall_at(samples: Sequence[Record], snapshot: JobSnapshot, rank: int, t_s: float) -> Record | None:
    """The sample of ``rank``'s stall that was going on at ``t_s`` (aligned seconds), or None.

    A stall began at a sample's time less its ``stalled_s``. Going on at ``t_s``: it began before, and a
    sample of it was taken at or after ``t_s`` (the best: it covers that moment), or the last one before
    was taken at least half-way there (samples come at each doubling, so a later one was due but the
    process ended), and the rank began no collective and reported no hang in between."""
    best: Record | None = None
    for x in sorted(samples, key=lambda x: x["time_ns"]):
        taken_s = x["time_ns"] / 1e9
        began_s = taken_s - float(x["stalled_s"])
        if began_s > t_s:
            break
        if taken_s >= t_s:
            return x  # this stall was going on at t_s
        best = x
    if best is None:
        return None
    taken_s = best["time_ns"] / 1e9
    began_s = taken_s - float(best["stalled_s"])
    if float(best["stalled_s"]) + TICK_S < (t_s - began_s) / 2:
        return None  # a later sample of it would have come: the stall had ended
    moved_on = any(
        c["rank"] == rank and taken_s < c["time_ns"] / 1e9 <= t_s for c in snapshot.collectives
    ) or any(h["rank"] == rank and began_s <= h["time_ns"] / 1e9 <= t_s for h in snapshot.hangs)
    return None if moved_on else best


def stall_sentence(rank: int, sample: Record, t_s: float) -> str:
    """' Rank 1 was then 5.0 s into a stall of its own after step 7, at monbar.py:11, blocked ...'"""
    began_s = sample["time_ns"] / 1e9 - float(sample["stalled_s"])
    phase = str(sample["phase"])
    when = (
        f"after step {sample['step']} (between steps)"
        if phase == "idle"
        else f"in step {sample['step']}'s {phase}"
    )
    site = sample.get("site")
    where = f", at {site}" if site else ", outside user code"
    if stack_waits_for_loader(str(sample.get("stack") or "")):
        where += ", waiting for its DataLoader's workers to deliver the next batch"
    cpu = sample.get("main_cpu_s")
    how = HOW[blocked(None if cpu is None else float(cpu), float(sample["stalled_s"]))]
    return (
        f" Rank {rank} was then {max(0.0, t_s - began_s):.1f} s into a stall of its own {when}{where}{how} "
        f"(its watchdog's sample {float(sample['stalled_s']):.1f} s in)."
    )
