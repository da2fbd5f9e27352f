"""Chrome / Perfetto trace-event JSON: one process per rank, compute and communication on separate
tracks, so the overlap (or its absence) is visible in ui.perfetto.dev or chrome://tracing.

Tracks (``tid``) per rank: 0 ``compute`` (forward, backward), 1 ``all-reduce`` (one span per bucket),
2 ``bucket ready`` (instant marks), 3 ``order penalty`` (a ready bucket waiting for its predecessor to
launch, ``buckets.order_wait_ns``, the figure ``/buckets`` and the timeline give: not the launch latency of
a bucket that had no predecessor to wait for). Timestamps are
microseconds from the earliest forward start in the trace, on the job's aligned clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpscope.server.analysis.buckets import order_wait_ns
from ddpscope.server.rows import StepRow

TRACKS = {0: "compute", 1: "all-reduce", 2: "bucket ready", 3: "order penalty"}


def trace_events(job: str, rows: Sequence[StepRow]) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    if not rows:
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"job": job}}
    t0 = min(r.forward_start_ns for r in rows)

    def us(ns: int) -> float:
        return (ns - t0) / 1e3

    def span(pid: int, tid: int, name: str, start: int, end: int, args: dict[str, Any]) -> None:
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "name": name,
                "ts": us(start),
                "dur": max(0, end - start) / 1e3,
                "args": args,
            }
        )

    for rank in sorted({r.rank for r in rows}):
        events.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}})
        for tid, name in TRACKS.items():
            events.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": name}})
    for r in rows:
        step = {"step": r.step}
        span(r.rank, 0, "forward", r.forward_start_ns, r.forward_end_ns, step)
        span(r.rank, 0, "backward", r.backward_start_ns, r.backward_end_ns, step)
        n = min(len(r.bucket_ready_ns), len(r.allreduce_start_ns), len(r.allreduce_end_ns))
        for i in range(n):
            args = {"step": r.step, "bucket": i, "bytes": r.bucket_bytes[i] if i < len(r.bucket_bytes) else 0}
            span(r.rank, 1, f"all-reduce b{i}", r.allreduce_start_ns[i], r.allreduce_end_ns[i], args)
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "pid": r.rank,
                    "tid": 2,
                    "name": f"ready b{i}",
                    "ts": us(r.bucket_ready_ns[i]),
                    "args": args,
                }
            )
            waited = order_wait_ns(r.bucket_ready_ns, r.allreduce_start_ns, i)
            if waited:
                ready = r.bucket_ready_ns[i]
                span(r.rank, 3, f"wait for b{i - 1} b{i}", ready, ready + waited, args)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"job": job, "t0_ns": t0}}
