"""Two processes of one rank reporting at once: two runs under one job id (``job_id_shared``), or one
launch that gave two processes the same ``RANK`` (``duplicate_rank``).

A job id names one run. When two runs share it (two launches that derive the same default id, a
``DDPSCOPE_JOB`` copied between launch scripts, a relaunch while the old processes still run), every rank has
two live processes: their steps, collectives and heartbeats mix, and every other diagnosis of the job
reads one run's records against the other's. When only some ranks have two (a launch script's off-by-one,
a rank computed from a node index), one launch started two processes as the same rank: the second one's
connections pair with the first one's peers, it waits in the rendezvous, the group's construction or the
first collective, and the other diagnoses read its wait as the rank's.

A process is live while its agent stream keeps sending: from its first record known here (``rank_start``,
the start of a stall its hang report covers, an error, its exit) to its last (its ``agent_stats``, which
comes every few seconds while it emits records, or any of those). Two processes of one rank overlap when
the older one kept sending ``OVERLAP_S`` after the newer one's first record, or when the newer one's hang
report (stalled, so live throughout) covers ``MIN_STALL_OVERLAP_S`` of the older one's span. A restart is
not: torchrun stops the old processes before it starts new ones.

``shared_job_incidents(snapshot)`` returns at most one incident per job. Pure function of a
``JobSnapshot`` (the whole of it: ``split_restart`` would set the older run aside); no database, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from ddpscope.agent.rank_spans import ranks_text
from ddpscope.server.analysis.incident_model import Incident, first_line, ranks_phrase, record_s
from ddpscope.server.analysis.snapshot import JobSnapshot, process_stream, without_processes

OVERLAP_S = 10.0
"""How long an older process must keep reporting after a newer one of its rank started to count as a
second process: twice the agent's accounting interval, so an old process's last records, stamped just as
a relaunch began on a slightly different clock, are not one."""
MIN_STALL_OVERLAP_S = 2.0
"""Enough when the newer process's own hang report says it was live (stalled) throughout."""


@dataclass(slots=True)
class _Process:
    """What the snapshot says of one agent stream (one process) of a rank."""

    stream: str
    first_s: float
    last_s: float
    start: Mapping[str, Any] | None = None
    """Its first ``rank_start``, when it got that far."""
    stalls: list[tuple[float, float]] = field(default_factory=list)
    """(stall start, report time) of each of its hang reports."""
    error: Mapping[str, Any] | None = None
    """Its first ``rank_error``."""

    @property
    def acted(self) -> bool:
        """It acted as a rank (announced itself, stalled, failed), not only kept accounts: a forked child
        that emitted something under its parent's rank is not a second process of that rank."""
        return self.start is not None or bool(self.stalls) or self.error is not None

    def see(self, first_s: float, last_s: float) -> None:
        self.first_s, self.last_s = min(self.first_s, first_s), max(self.last_s, last_s)


@dataclass(slots=True)
class _Overlaps:
    processes: dict[int, dict[str, _Process]]
    by_rank: dict[int, tuple[_Process, _Process, float]]
    """Per rank with two processes at once: (older, newer, how long the older kept reporting after)."""

    @property
    def single(self) -> list[int]:
        """Ranks with one process only. A second run gives every rank a second process; a duplicated RANK
        only some."""
        return sorted(r for r, procs in self.processes.items() if len(procs) == 1)


def twin_processes(snapshot: JobSnapshot) -> set[tuple[int, str]]:
    """``(rank, stream)`` of the second process of each rank a ``duplicate_rank`` names: the one that never
    announced itself (stuck or failed in its set-up), else the newer. The other diagnoses leave it out, so
    they read the rank that trained, not its twin's wait (the incident says what became of the twin)."""
    found = _overlaps(snapshot)
    if not found.by_rank or not found.single:
        return set()
    twins = set()
    for rank, (older, newer, _) in found.by_rank.items():
        twin = older if older.start is None and newer.start is not None else newer
        twins.add((rank, twin.stream))
    return twins


def without_twins(snapshot: JobSnapshot) -> JobSnapshot:
    """``snapshot`` without the ``twin_processes``: what the job's status and other diagnoses read."""
    twins = twin_processes(snapshot)
    return without_processes(snapshot, twins) if twins else snapshot


def _overlaps(snapshot: JobSnapshot) -> _Overlaps:
    overlaps: dict[int, tuple[_Process, _Process, float]] = {}
    processes = _processes(snapshot)
    for rank, procs in sorted(processes.items()):
        for older, newer in combinations(sorted(procs.values(), key=lambda p: p.first_s), 2):
            if not (older.acted and newer.acted):
                continue
            overlap_s = older.last_s - newer.first_s  # the newer one is live from its first record on
            stalled_beside = any(
                min(older.last_s, at) - max(older.first_s, since) >= MIN_STALL_OVERLAP_S
                for since, at in newer.stalls
            )
            if overlap_s > OVERLAP_S or stalled_beside:
                overlaps.setdefault(rank, (older, newer, overlap_s))
    return _Overlaps(processes, overlaps)


def shared_job_incidents(snapshot: JobSnapshot) -> list[Incident]:
    """One ``job_id_shared`` incident when every rank has two processes reporting at once, one
    ``duplicate_rank`` incident when some ranks do; else none."""
    found = _overlaps(snapshot)
    overlaps, processes, single = found.by_rank, found.processes, found.single
    if not overlaps:
        return []
    others = sorted(overlaps)
    rank = others[0]
    older, newer, overlap_s = overlaps[rank]
    if not single:
        alike = f"; {ranks_text(others)} alike" if len(others) > 1 else ""
        return [
            Incident(
                kind="job_id_shared",
                message=(
                    f"Two runs report under job id {snapshot.job} at once: rank {rank} has a process "
                    f"{_process(older)} that kept reporting {overlap_s:.0f} s after another started "
                    f"{_process(newer)}{alike}. Their steps, collectives and heartbeats mix, so this job's "
                    "views and incidents describe neither run. Give each run its own job id (DDPSCOPE_JOB, or "
                    "torchrun's --rdzv-id), or stop the older run."
                ),
                rank=rank,
                culprit_ranks=others,
                time_s=newer.first_s,
            )
        ]
    world = snapshot.world_size
    missing = sorted(set(range(world)) - set(processes)) if world else []
    unfilled = (
        f"; no process reported as {ranks_phrase(missing)} of the world of {world}, which the duplicates were "
        "probably meant to be"
        if missing
        else ""
    )
    twice = "two processes" if len(others) == 1 else "two processes each"
    return [
        Incident(
            kind="duplicate_rank",
            message=(
                f"{ranks_phrase(others).capitalize()} {'has' if len(others) == 1 else 'have'} {twice} at once, "
                f"while {ranks_phrase(single)} {'has' if len(single) == 1 else 'have'} one: rank {rank}'s "
                f"process {_process(older)} and another {_process(newer)} started "
                f"{max(0.0, newer.first_s - older.first_s):.0f} s later{_newer_state(newer)}{unfilled}. One "
                f"launch gave two processes the same RANK: give each process of the job its own, 0 to "
                "WORLD_SIZE-1 (check the launch script's rank arithmetic, or launch with torchrun, which "
                "assigns them). The second process's connections pair with its twin's peers, so it waits or "
                "fails there; the other incidents of this job leave it out."
            ),
            rank=rank,
            culprit_ranks=others,
            time_s=newer.first_s,
        )
    ]


def _processes(snapshot: JobSnapshot) -> dict[int, dict[str, _Process]]:
    """Per rank, each process's span, from what the snapshot keeps of each agent stream (derived streams,
    such as a crash handler's, count as their process's; a shipper's late accounting does not extend it)."""
    out: dict[int, dict[str, _Process]] = {}

    def see(rank: int, stream: str, first_s: float, last_s: float) -> _Process:
        procs = out.setdefault(rank, {})
        proc = procs.get(stream)
        if proc is None:
            proc = procs[stream] = _Process(stream, first_s, last_s)
        else:
            proc.see(first_s, last_s)
        return proc

    for s in sorted(snapshot.starts, key=lambda s: s["time_ns"]):
        proc = see(s["rank"], process_stream(str(s["stream"])), record_s(s), record_s(s))
        proc.start = proc.start or s
    for h in snapshot.hangs:
        at = record_s(h)
        since = at - float(h.get("stalled_s") or 0.0)
        see(h["rank"], process_stream(str(h["stream"])), since, at).stalls.append((since, at))
    for e in sorted(snapshot.rank_errors, key=record_s):
        proc = see(e["rank"], process_stream(str(e["stream"])), record_s(e), record_s(e))
        proc.error = proc.error or e
    for x in snapshot.rank_exits:
        see(x["rank"], process_stream(str(x["stream"])), record_s(x), record_s(x))
    for (rank, stream), ns in snapshot.stream_seen_ns.items():
        if process_stream(stream) == stream:
            see(rank, stream, ns / 1e9, ns / 1e9)
    return out


def _process(proc: _Process) -> str:
    start = proc.start
    if start is None:
        return "(that never announced itself: it did not get through its DDP model's construction)"
    return f"(pid {start.get('pid')} on {start.get('host')}, world size {start.get('world_size')})"


def _newer_state(proc: _Process) -> str:
    """What became of the second process, from its own reports."""
    said = []
    if proc.stalls:
        since, at = proc.stalls[0]
        said.append(f"stalled {at - since:.0f} s (its hang report)")
    if proc.error is not None:
        said.append(
            f"failed ({proc.error.get('error_type')}: {first_line(str(proc.error.get('message', '')), 160)})"
        )
    return f" and {', then '.join(said)}" if said else ""
