"""Job-level summaries: status (through ``status.job_status`` when it exists) and step rate.

``status.py`` and ``incidents.py`` are written separately; until they exist, a job is ``finished``
when every rank sent ``rank_exit`` and ``running`` otherwise, with no incidents.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from ddpscope.server.analysis.snapshot import JobSnapshot

logger = logging.getLogger(__name__)


def _optional(module: str, attr: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # the module exists but is broken: do not hide that
        return None
    return getattr(mod, attr, None)


def job_status(snapshot: JobSnapshot, now_s: float) -> str:
    impl = _optional("ddpscope.server.analysis.status", "job_status")
    if impl is not None:
        return str(impl(snapshot, now_s))
    exited = {r["rank"] for r in snapshot.rank_exits}
    if snapshot.world_size and len(exited) >= snapshot.world_size:
        return "finished"
    return "running"


def has_diagnosis() -> bool:
    """True when the incidents module is installed (else ``diagnose`` returns nothing)."""
    return _optional("ddpscope.server.analysis.incidents", "diagnose") is not None


def diagnose(snapshot: JobSnapshot, now_s: float) -> list[Any]:
    impl = _optional("ddpscope.server.analysis.incidents", "diagnose")
    return [] if impl is None else list(impl(snapshot, now_s))


@dataclass(slots=True)
class JobSummary:
    job: str
    world_size: int
    status: str
    last_seen: float
    """Aligned-clock (≈ wall-clock) seconds of the newest record."""
    first_seen: float
    steps: int
    """Highest step number any rank completed, plus one (0 before the first step)."""
    step_rate: float | None
    """Steps per second since the job's first record."""


def summarize(snapshot: JobSnapshot, first_seen_s: float, status: str) -> JobSummary:
    last_steps = [s.last_step for s in snapshot.steps.values()]
    steps = max(last_steps) + 1 if last_steps else 0
    ends = [s.last_step_end_ns / 1e9 for s in snapshot.steps.values()]
    span = (max(ends) - first_seen_s) if ends else 0.0
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
