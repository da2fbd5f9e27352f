"""Chrome / Perfetto trace-event JSON: one process per rank, compute and communication on separate
tracks, so the overlap (or its absence) is visible in ui.perfetto.dev or chrome://tracing.

Tracks (``tid``) per rank: 0 ``compute`` (forward, backward), 1 ``all-reduce`` (one span per bucket),
2 ``bucket ready`` (instant marks), 3 ``order penalty`` (a ready bucket waiting for its predecessor to
launch, ``buckets.order_wait_ns``, the figure ``/buckets`` and the timeline give: not the launch latency of
a bucket that had no predecessor to wait for). Timestamps are
microseconds from the earliest forward start in the trace, on the job's aligned clock.

Where a rank stopped (``stops.py``) is a process-wide instant mark at its report's time: hung, failed
or exited, with the report's words. The step it hung or failed in, which has no step record, is drawn
from the report's partial step: its spans still open then end at the mark, named ``(unfinished)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpscope.agent.records import UNTIMED_END
from ddpscope.server.analysis.buckets import order_wait_ns
from ddpscope.server.analysis.stops import Stop
from ddpscope.server.rows import StepRow

TRACKS = {0: "compute", 1: "all-reduce", 2: "bucket ready", 3: "order penalty"}


def trace_events(
    job: str, rows: Sequence[StepRow], stops: Mapping[int, Stop] | None = None
) -> dict[str, Any]:
    """The trace of ``rows`` and of the ranks' ``stops`` (the caller picks those of the steps asked for)."""
    events: list[dict[str, Any]] = []
    stops = stops or {}
    finished = {(r.rank, r.step) for r in rows}
    unfinished = [
        s for s in stops.values() if s.partial is not None and (s.rank, s.partial.step) not in finished
    ]
    starts = [r.forward_start_ns for r in rows] + [
        s.partial.forward_start_ns for s in unfinished if s.partial
    ]
    if not starts and not stops:
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"job": job}}
    t0 = min(starts) if starts else min(s.time_ns for s in stops.values())

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

    for rank in sorted({r.rank for r in rows} | set(stops)):
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
    for stop in unfinished:
        p = stop.partial
        assert p is not None
        until = stop.until_ns
        about: dict[str, Any] = {"step": p.step, "state": stop.state}
        span(stop.rank, 0, "forward" + ("" if p.forward_end_ns else " (unfinished)"),
             p.forward_start_ns, p.forward_end_ns or until, about)  # fmt: skip
        if p.backward_start_ns:
            span(stop.rank, 0, "backward (unfinished)", p.backward_start_ns, until, about)
        for i, (start, end) in enumerate(zip(p.allreduce_start_ns, p.allreduce_end_ns, strict=False)):
            if start and end != UNTIMED_END:
                name = f"all-reduce b{i}" + ("" if end else " (unfinished)")
                span(stop.rank, 1, name, start, end or until, {**about, "bucket": i})
    for stop in stops.values():
        idle = stop.phase == "idle"
        phase = " between steps" if idle else f" in {stop.phase}" if stop.phase else ""
        at_step = "" if stop.step is None else f" ({'after ' if idle else ''}step {stop.step})"
        events.append(
            {
                "ph": "i",
                "s": "p",
                "pid": stop.rank,
                "tid": 0,
                "name": f"{stop.state}{phase}{at_step}",
                "ts": us(stop.time_ns),
                "args": {"state": stop.state, "step": stop.step, "message": stop.message},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"job": job, "t0_ns": t0}}
