"""One step across ranks on one clock: seconds from the step's earliest forward start.

Times in records are already on the job's aligned clock (each rank's offset to rank 0 was added at
the source), so aligning is a subtraction.

A step some ranks never finished (the job hung or crashed in it) is drawn from their reports'
partial steps (``stops.py``): such a rank's ``state`` is ``hung`` or ``failed``, its spans that were
still open end at ``until`` (when the report was written), and each bucket all-reduce still in flight
then is ``open``. Ranks with no record of the step at all, but a report of where they stopped instead
(another step, or out of the job), are listed in ``elsewhere``; so is a rank that has sent nothing for
longer than the collector calls a rank silent (``silent``: killed outright, it sent no report).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ddpscope.agent.records import UNTIMED_END
from ddpscope.server.analysis.buckets import order_wait_ns
from ddpscope.server.analysis.status import DEFAULT_SILENT_AFTER_S
from ddpscope.server.analysis.steps import NS, step_metrics
from ddpscope.server.analysis.stops import Stop
from ddpscope.server.rows import StepRow

COMPLETED = "completed"
SILENT = "silent"


@dataclass(slots=True)
class BucketSpan:
    index: int
    ready: float | None
    """None: a gradient of the bucket had not arrived (an unfinished step)."""
    allreduce: tuple[float, float | None] | None
    """None: not launched; end None: it completed at a time the rank had not recorded yet."""
    bytes: int
    order_penalty_s: float
    """Launch minus ready: time the ready bucket waited for an earlier bucket index."""
    open: bool = False
    """Still in flight when the rank's report was written (its end is then ``until``)."""


@dataclass(slots=True)
class RankTimeline:
    rank: int
    forward: tuple[float, float]
    backward: tuple[float, float] | None
    """None: an unfinished step whose backward had not begun."""
    exposed_comm_s: float | None
    overlap_ratio: float | None
    buckets: list[BucketSpan] = field(default_factory=list)
    state: str = COMPLETED
    """``completed`` (its step record), or ``hung`` / ``failed`` (an unfinished step from its report)."""
    phase: str | None = None
    """An unfinished step's phase when the report was written (forward, backward, allreduce...)."""
    until: float | None = None
    """An unfinished step: when the report was written, the end of the spans still open then."""
    message: str | None = None
    """An unfinished step: the report's own words (the hang's diagnosis, the error)."""


@dataclass(slots=True)
class Elsewhere:
    """A rank with no record of this step that reported where it stopped instead."""

    rank: int
    state: str
    step: int | None
    phase: str | None
    message: str


@dataclass(slots=True)
class Timeline:
    step: int
    t0_ns: int
    """Aligned-clock time of the earliest forward start: the zero of every span."""
    ranks: list[RankTimeline]
    elsewhere: list[Elsewhere] = field(default_factory=list)


def timeline(
    step: int,
    rows: Sequence[StepRow],
    stops: Mapping[int, Stop] | None = None,
    heard: Mapping[int, tuple[int | None, int]] | None = None,
    now_ns: int = 0,
) -> Timeline | None:
    """The timeline of ``step`` from its rows (one per rank; extra rows of other steps ignored) and the
    ranks' stops (``stops.stops``), None when neither has anything of the step. ``heard``: each rank of
    the job -> (its last step, when it was last heard from); ``now_ns``: the aligned-clock time now."""
    rows = [r for r in rows if r.step == step]
    done = {r.rank for r in rows}
    stops = stops or {}
    unfinished = [
        s for s in stops.values() if s.rank not in done and s.partial is not None and s.partial.step == step
    ]
    if not rows and not unfinished:
        return None
    t0 = min(
        [r.forward_start_ns for r in rows] + [s.partial.forward_start_ns for s in unfinished if s.partial]
    )

    def s(ns: int) -> float:
        return (ns - t0) / NS

    ranks = [_completed(r, s) for r in rows]
    ranks += [_unfinished(stop, s) for stop in unfinished]
    ranks.sort(key=lambda r: r.rank)
    present = {r.rank for r in ranks}
    elsewhere = [
        Elsewhere(rank=x.rank, state=x.state, step=x.step, phase=x.phase, message=x.message)
        for x in stops.values()
        if x.rank not in present
    ]
    for rank, (last_step, seen_ns) in (heard or {}).items():
        # A live rank's heartbeats come every few seconds: one quiet for longer is gone, not late.
        if rank not in present and rank not in stops and now_ns - seen_ns > DEFAULT_SILENT_AFTER_S * NS:
            after = "" if last_step is None else f", after step {last_step}"
            message = (
                f"nothing heard from it for {(now_ns - seen_ns) / NS:.0f} s{after}: killed outright (SIGKILL, "
                "the OOM killer), crashed in native code, or stopped (SIGSTOP, a debugger)"
            )
            elsewhere.append(Elsewhere(rank=rank, state=SILENT, step=last_step, phase=None, message=message))
    elsewhere.sort(key=lambda x: x.rank)
    return Timeline(step=step, t0_ns=t0, ranks=ranks, elsewhere=elsewhere)


def _completed(r: StepRow, s: Callable[[int], float]) -> RankTimeline:
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
    return RankTimeline(
        rank=r.rank,
        forward=(s(r.forward_start_ns), s(r.forward_end_ns)),
        backward=(s(r.backward_start_ns), s(r.backward_end_ns)),
        exposed_comm_s=m.exposed_comm_s,
        overlap_ratio=m.overlap_ratio,
        buckets=buckets,
    )


def _unfinished(stop: Stop, s: Callable[[int], float]) -> RankTimeline:
    r = stop.partial
    assert r is not None
    until = s(stop.until_ns)
    buckets = []
    for i in range(min(len(r.bucket_ready_ns), len(r.allreduce_start_ns), len(r.allreduce_end_ns))):
        ready, start, end = r.bucket_ready_ns[i], r.allreduce_start_ns[i], r.allreduce_end_ns[i]
        span: tuple[float, float | None] | None = None
        if start:
            span = (s(start), None if end == UNTIMED_END else s(end) if end else until)
        buckets.append(
            BucketSpan(
                index=i,
                ready=s(ready) if ready else None,
                allreduce=span,
                bytes=r.bucket_bytes[i] if i < len(r.bucket_bytes) else 0,
                order_penalty_s=order_wait_ns(r.bucket_ready_ns, r.allreduce_start_ns, i) / NS,
                open=bool(start) and not end,
            )
        )
    return RankTimeline(
        rank=stop.rank,
        forward=(s(r.forward_start_ns), s(r.forward_end_ns) if r.forward_end_ns else until),
        backward=(s(r.backward_start_ns), until) if r.backward_start_ns else None,
        exposed_comm_s=None,
        overlap_ratio=None,
        buckets=buckets,
        state=stop.state,
        phase=stop.phase,
        until=until,
        message=stop.message,
    )
