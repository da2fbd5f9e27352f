"""Per-step views of one job: steps, timeline, buckets, stragglers, unused parameters."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool

from ddpscope.server.analysis.buckets import bucket_stats
from ddpscope.server.analysis.host_load import with_contention
from ddpscope.server.analysis.profile_sites import LOOKBACK_NS, with_profiled, with_sites
from ddpscope.server.analysis.stalls import WINDOW_STEPS as STALL_WINDOW_STEPS
from ddpscope.server.analysis.stalls import intermittent_stalls
from ddpscope.server.analysis.steps import page_metrics, page_timings
from ddpscope.server.analysis.stops import Stop, newest_partial_step, stops
from ddpscope.server.analysis.stragglers import THRESHOLD, WINDOW_STEPS, stragglers
from ddpscope.server.analysis.timeline import timeline
from ddpscope.server.analysis.unused import aggregate_unused, unused_report
from ddpscope.server.deps import JobIdDep, StorageDep
from ddpscope.server.routes._items import JSONResponse, items
from ddpscope.server.storage import JobRow, Storage, latest_by_rank

router = APIRouter(prefix="/api/v1/jobs/{job}", tags=["steps"])

DEFAULT_LIMIT = 10_000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Query integers are bounded to what the databases store; beyond it is a 422, not a server error."""


def _parse_cursor(cursor: str | None) -> tuple[int, int] | None:
    if cursor is None:
        return None
    step, sep, rank = cursor.partition(".")
    # Bounded to BIGINT: a larger number would fail in the database driver (a 500, not a 400).
    if not sep or not step.lstrip("-").isdigit() or not rank.isdigit() or max(len(step), len(rank)) > 18:
        raise HTTPException(
            400, f"cursor {cursor!r} is malformed: pass back the 'next' value of the previous page"
        )
    return int(step), int(rank)


def check_step_range(start: int | None, end: int | None) -> None:
    """A step range whose end is before its start is a 400, the same for every view that takes one."""
    if start is not None and end is not None and end < start:
        raise HTTPException(400, f"end ({end}) is before start ({start})")


def _steps(
    storage: Storage,
    job_id: int,
    rank: int | None,
    start: int | None,
    end: int | None,
    limit: int,
    cursor: str | None,
) -> Response:
    page = storage.step_page(
        job_id, rank=rank, start=start, end=end, limit=limit + 1, after=_parse_cursor(cursor)
    )
    more = len(page) > limit
    page = page.head(limit)
    nxt = f"{page.step[-1]}.{page.rank[-1]}" if more else None
    return items(page_metrics(page), next=nxt)


@router.get("/steps")
async def steps(
    job_id: JobIdDep,
    storage: StorageDep,
    rank: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None,
    start: Annotated[
        int | None, Query(description="first step (inclusive)", ge=INT64_MIN, le=INT64_MAX)
    ] = None,
    end: Annotated[int | None, Query(description="last step (inclusive)", ge=INT64_MIN, le=INT64_MAX)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = DEFAULT_LIMIT,
    cursor: Annotated[str | None, Query(description="the 'next' value of the previous page")] = None,
) -> Response:
    """Per rank and step: ``step_s``, ``forward_s``, ``backward_s``, ``comm_s``, ``exposed_comm_s``, ``overlap_ratio``."""
    check_step_range(start, end)
    return await run_in_threadpool(_steps, storage, job_id, rank, start, end, limit, cursor)


def job_stops(storage: Storage, job: str, row: JobRow | None = None) -> dict[int, Stop]:
    """Where each rank of ``job`` stopped (``analysis/stops.py``), hung ranks up to when last heard from
    (``row``: the job's row, if the caller has it)."""
    row = row if row is not None else storage.job_row(job)
    seen = {r.rank: r.last_seen_ns for r in row.ranks} if row is not None else {}
    return stops(storage.stop_reports(job), seen)


def _timeline(storage: Storage, job: str, job_id: int, step: int | None) -> Response:
    row = storage.job_row(job)
    stopped = job_stops(storage, job, row)
    if step is None:
        # The step the job is in: the one it hung or crashed in, when no rank finished it.
        known = [s for s in (storage.last_step(job_id), newest_partial_step(stopped)) if s is not None]
        if not known:
            raise HTTPException(404, f"job {job!r} has no step records yet")
        step = max(known)
    heard = {r.rank: (r.last_step, r.last_seen_ns) for r in row.ranks} if row is not None else {}
    tl = timeline(step, storage.steps(job_id, start=step, end=step), stopped, heard, time.time_ns())
    if tl is None:
        raise HTTPException(404, f"job {job!r} has no records of step {step}")
    return JSONResponse(tl)


@router.get("/timeline")
async def get_timeline(
    job: str,
    job_id: JobIdDep,
    storage: StorageDep,
    step: Annotated[int | None, Query(ge=INT64_MIN, le=INT64_MAX)] = None,
) -> Response:
    """``ranks``: per rank ``forward``/``backward`` [start, end] s from the step's earliest start, and ``buckets``;
    for a step a rank hung or failed in, its ``state``, ``until`` and open spans; ``elsewhere``: ranks that
    stopped in another step or left the job. No ``step``: the latest step, finished or not."""
    return await run_in_threadpool(_timeline, storage, job, job_id, step)


def _buckets(storage: Storage, job: str, job_id: int, recent: int) -> Response:
    layouts = storage.fetch_records(job, ["layout"])
    engines = {r.get("engine") for r in storage.fetch_records(job, ["rank_start"])}
    engine = engines.pop() if len(engines) == 1 else None  # the advice differs by engine
    return items(bucket_stats(layouts, storage.recent_steps(job_id, recent), engine))


@router.get("/buckets")
async def buckets(
    job: str, job_id: JobIdDep, storage: StorageDep, steps: Annotated[int, Query(ge=1, le=10_000)] = 200
) -> Response:
    """The current bucket layout with out-of-order counts and order penalty over the last ``steps`` steps."""
    return await run_in_threadpool(_buckets, storage, job, job_id, steps)


def _stragglers(storage: Storage, job: str, job_id: int, threshold: float, window: int) -> Response:
    page = storage.recent_step_page(job_id, window + 1)  # each step's predecessor: between-steps time
    found = stragglers(page_timings(page), threshold=threshold, window=window)
    if any(s.flagged for s in found):
        found = with_contention(found, latest_by_rank(storage.fetch_records(job, ["rank_start"])).values())
        since = int(page.forward_start_ns.min()) - LOOKBACK_NS
        found = with_sites(found, storage.events_since(job_id, "site_profile", since))
    return items(found, threshold=threshold, window=window)


@router.get("/stragglers")
async def get_stragglers(
    job: str,
    job_id: JobIdDep,
    storage: StorageDep,
    threshold: Annotated[float, Query(gt=0, le=10)] = THRESHOLD,
    window: Annotated[int, Query(ge=3, le=1000)] = WINDOW_STEPS,
) -> Response:
    """Every rank: ``slowdown`` (compute over the median of the others), ``steps_flagged``, ``flagged``, ``phase``,
    ``contention`` when a flagged rank's host has more compute threads than cores, and ``sampled`` (``site``,
    ``samples``, ``of``): the line a flagged rank's slow phase was sampled at most."""
    return await run_in_threadpool(_stragglers, storage, job, job_id, threshold, window)


def _stalls(storage: Storage, job_id: int, window: int) -> Response:
    page = storage.recent_step_page(job_id, window + 1)  # each step's predecessor: between-steps time
    since = int(page.forward_start_ns.min()) if len(page.step) else 0
    found = intermittent_stalls(
        page_timings(page), window=window, samples=storage.events_since(job_id, "stall_sample", since)
    )
    if any(s.sampled is None or not s.sampled.site for s in found):
        found = with_profiled(found, storage.events_since(job_id, "site_profile", since - LOOKBACK_NS))
    return items([{**asdict(s), "message": s.sentence()} for s in found], window=window)


@router.get("/stalls")
async def get_stalls(
    job_id: JobIdDep,
    storage: StorageDep,
    steps: Annotated[int, Query(ge=10, le=2000)] = STALL_WINDOW_STEPS,
) -> Response:
    """Ranks that hold every other rank up now and then rather than in most steps (``analysis/stalls.py``):
    ``rank``, ``stalls``, ``every``, ``median_excess_s``, ``share``, ``phase``, ``steps``, ``sampled`` (where the
    rank's training thread was in them: ``site``, ``samples``, ``of``, ``stalls``, ``blocked``, ``stack``, ``from_s``,
    ``loader``, ``thread``, ``waits_on``; null when its watchdog sampled none), ``message``; over the last ``steps`` steps. Apart from ``/stragglers``, which stays a short read: this one reads ten times the steps."""
    return await run_in_threadpool(_stalls, storage, job_id, steps)


def _unused(storage: Storage, job: str, job_id: int) -> Response:
    found = aggregate_unused(storage.unused_rows(job_id))
    ranks = storage.fetch_records(job, ["rank_start"])
    row = storage.job_row(job)
    seen = max((r.step_records for r in row.ranks), default=0) if row else 0
    report = unused_report(
        found,
        any(r["find_unused_parameters"] for r in ranks),
        seen,
        static_graph=any(r.get("static_graph") for r in ranks),
    )
    return items(report.items, find_unused_parameters=report.find_unused_parameters, advice=report.advice)


@router.get("/unused-parameters")
async def unused_parameters(job: str, job_id: JobIdDep, storage: StorageDep) -> Response:
    """Parameters that got no gradient: ``name``, ``ranks``, ``steps``; ``advice`` on find_unused_parameters."""
    return await run_in_threadpool(_unused, storage, job, job_id)
