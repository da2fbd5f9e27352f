"""Job-level summaries: status, progress, step rate and who each rank is.

Status and incidents are ``status.job_status`` and ``incidents.diagnose``; this module only puts a
job's headline numbers together for ``/api/v1/jobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpscope.server.analysis.snapshot import JobSnapshot

RANK_FIELDS = (
    "host",
    "pid",
    "engine",
    "backend",
    "device",
    "process_group",
    "torch_version",
    "ddpscope_version",
    "python_version",
    "clock_offset_ns",
    "clock_error_ns",
)
"""What ``rank_table`` shows of each rank's latest ``rank_start``: where to look for its process."""


def rank_table(snapshot: JobSnapshot) -> list[dict[str, Any]]:
    """One row per rank that announced itself (its latest ``rank_start``: a restarted rank shows its
    new process), by rank, with ``started`` in aligned-clock seconds."""
    rows = []
    for rank, start in sorted(snapshot.ranks.items()):
        row: dict[str, Any] = {"rank": rank, "started": start["time_ns"] / 1e9}
        row.update({name: start.get(name) for name in RANK_FIELDS})
        rows.append(row)
    return rows


@dataclass(slots=True)
class JobSummary:
    job: str
    world_size: int
    status: str
    last_seen: float
    """Aligned-clock (≈ wall-clock) seconds of the newest record."""
    first_seen: float
    steps: int
    """The step the current processes reached: the highest of the ranks' last completed steps, plus
    one (0 before the first step). After a restart, the new processes' step, not the old ones'."""
    step_rate: float | None
    """Steps per second since the current processes started (the job's first record when no rank
    announced itself)."""


def summarize(snapshot: JobSnapshot, first_seen_s: float, status: str) -> JobSummary:
    # A rank's last step is its current process's once it ended after that process started. Right after a
    # restart it is still the earlier process's: the step count stays as it was until the new processes
    # complete one, and no rate is made of it (it said 16 steps at 8 a second, then 11 at 1.6).
    current = [
        s
        for r, s in snapshot.steps.items()
        if r not in snapshot.ranks or s.last_step_end_ns >= snapshot.ranks[r]["time_ns"]
    ]
    last_steps = [s.last_step for s in current or snapshot.steps.values()]
    steps = max(last_steps) + 1 if last_steps else 0
    ends = [s.last_step_end_ns / 1e9 for s in current]
    # The latest rank_start of each rank: a restart's wait and the old processes' steps are not rate.
    began = min((r["time_ns"] / 1e9 for r in snapshot.ranks.values()), default=first_seen_s)
    span = (max(ends) - max(first_seen_s, began)) if ends else 0.0
    rate = steps / span if span > 0 else None
    return JobSummary(
        job=snapshot.job,
        world_size=snapshot.world_size,
        status=status,
        last_seen=snapshot.last_seen_s,
        first_seen=first_seen_s,
        steps=steps,
        step_rate=rate,
    )
