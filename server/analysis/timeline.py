"""One step across ranks on one clock: seconds from the step's earliest forward start.

Times in records are already on the job's aligned clock (each rank's offset to rank 0 was added at
the source), so aligning is a subtraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ddpscope.server.analysis.buckets import order_wait_ns
from ddpscope.server.analysis.steps import NS, step_metrics
from ddpscope.server.rows import StepRow


@dataclass(slots=True)
class BucketSpan:
    index: int
    ready: float
    allreduce: tuple[float, float]
    bytes: int
    order_penalty_s: float
    """Launch minus ready: time the ready bucket waited for an earlier bucket index."""


@dataclass(slots=True)
class RankTimeline:
    rank: int
    forward: tuple[float, float]
    backward: tuple[float, float]
    exposed_comm_s: float
    overlap_ratio: float | None
    buckets: list[BucketSpan] = field(default_factory=list)


@dataclass(slots=True)
class Timeline:
    step: int
    t0_ns: int
    """Aligned-clock time of the earliest forward start: the zero of every span."""
    ranks: list[RankTimeline]


def timeline(step: int, rows: Sequence[StepRow]) -> Timeline | None:
    """The timeline of ``step`` from its rows (one per rank; extra rows of other steps ignored)."""
    rows = [r for r in rows if r.step == step]
    if not rows:
        return None
    t0 = min(r.forward_start_ns for r in rows)

    def s(ns: int) -> float:
        return (ns - t0) / NS

    ranks = []
    for r in sorted(rows, key=lambda r: r.rank):
        m = step_metrics(r)
        buckets = [
            BucketSpan(
                index=i,
                ready=s(r.bucket_ready_ns[i]),
                allreduce=(s(r.allreduce_start_ns[i]), s(r.allreduce_end_ns[i])),
                bytes=r.bucket_bytes[i] if i < len(r.bucket_bytes) else 0,
                order_penalty_s=order_wait_ns(r.bucket_ready_ns, r.allreduce_start_ns, i) / NS,
            )
            for i in range(min(len(r.bucket_ready_ns), len(r.allreduce_start_ns), len(r.allreduce_end_ns)))
        ]
        ranks.append(
            RankTimeline(
                rank=r.rank,
                forward=(s(r.forward_start_ns), s(r.forward_end_ns)),
                backward=(s(r.backward_start_ns), s(r.backward_end_ns)),
                exposed_comm_s=m.exposed_comm_s,
                overlap_ratio=m.overlap_ratio,
                buckets=buckets,
            )
        )
    return Timeline(step=step, t0_ns=t0, ranks=ranks)
