"""Two runs reporting under one job id at once: ``job_id_shared``.

A job id names one run. When two runs share it (two launches that derive the same default id, a
``DDPSCOPE_JOB`` copied between launch scripts, a relaunch while the old processes still run), a rank has
two live processes: their steps, collectives and heartbeats mix, and every other diagnosis of the job
reads one run's records against the other's. A process is live while its agent stream keeps sending
(``agent_stats`` comes every few seconds while it emits records); two processes of one rank that each
announced themselves (``rank_start``) and both kept sending after the later one started are two runs at
once. A restart is not: torchrun stops the old processes before it starts new ones.

``shared_job_incidents(snapshot)`` returns at most one incident per job. Pure function of a
``JobSnapshot`` (the whole of it: ``split_restart`` would set the older run aside); no database, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any

from ddpscope.agent.rank_spans import ranks_text
from ddpscope.server.analysis.incident_model import Incident
from ddpscope.server.analysis.snapshot import JobSnapshot

OVERLAP_S = 10.0
"""How long an older process must keep reporting after a newer one of its rank started to count as a
second run: twice the agent's accounting interval, so an old process's last records, stamped just as a
relaunch began on a slightly different clock, are not one."""


def shared_job_incidents(snapshot: JobSnapshot) -> list[Incident]:
    """One ``job_id_shared`` incident when some rank has two processes reporting at once, else none."""
    overlaps: dict[int, tuple[Mapping[str, Any], Mapping[str, Any], float]] = {}
    for rank, starts in _starts_by_stream(snapshot).items():
        ordered = sorted(starts.values(), key=lambda s: s["time_ns"])
        for older, newer in pairwise(ordered):
            seen_ns = snapshot.stream_seen_ns.get((rank, older["stream"]), 0)
            overlap_s = (seen_ns - newer["time_ns"]) / 1e9
            if overlap_s > OVERLAP_S and rank not in overlaps:
                overlaps[rank] = (older, newer, overlap_s)
    if not overlaps:
        return []
    rank = min(overlaps)
    older, newer, overlap_s = overlaps[rank]
    others = sorted(overlaps)
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
            time_s=newer["time_ns"] / 1e9,
        )
    ]


def _starts_by_stream(snapshot: JobSnapshot) -> dict[int, dict[str, Mapping[str, Any]]]:
    """Per rank, each agent stream's first ``rank_start`` (a process that built two models sent two)."""
    out: dict[int, dict[str, Mapping[str, Any]]] = {}
    for s in sorted(snapshot.starts, key=lambda s: s["time_ns"]):
        out.setdefault(s["rank"], {}).setdefault(s["stream"], s)
    return out


def _process(start: Mapping[str, Any]) -> str:
    return f"(pid {start.get('pid')} on {start.get('host')}, world size {start.get('world_size')})"
