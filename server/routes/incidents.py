"""Incidents (the cross-rank diagnosis) and the Perfetto trace of one job."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool

from ddpscope.server.analysis.incident_model import INCIDENT_KINDS
from ddpscope.server.analysis.incidents import diagnose
from ddpscope.server.analysis.trace import trace_events
from ddpscope.server.deps import JobIdDep, StorageDep
from ddpscope.server.routes._items import JSONResponse, item
from ddpscope.server.routes.steps import INT64_MAX, INT64_MIN, check_step_range, job_stops
from ddpscope.server.storage import Storage

router = APIRouter(prefix="/api/v1/jobs/{job}", tags=["incidents"])

TRACE_MAX_STEPS = 2000
"""A whole-job trace covers at most this many steps (the last ones); ask for ?start=&end= for others."""


def _incidents(storage: Storage, job: str, kind: str | None) -> Response:
    snap = storage.load_snapshot(job)
    if snap is None:
        raise HTTPException(404, f"job {job!r} not found")
    found = [item(i) for i in diagnose(snap, time.time())]
    if kind is not None:
        # A newer agent's warning code is a kind this collector does not list: known if the job has it.
        if kind not in INCIDENT_KINDS and all(i.get("kind") != kind for i in found):
            raise HTTPException(
                400,
                f"kind {kind!r} is not an incident kind; expected one of {', '.join(sorted(INCIDENT_KINDS))}",
            )
        found = [i for i in found if i.get("kind") == kind]
    return JSONResponse({"items": found})


@router.get("/incidents")
async def incidents(job: str, _job_id: JobIdDep, storage: StorageDep, kind: str | None = None) -> Response:
    """One item per diagnosis: ``kind``, ``rank``, ``step``, ``seq``, ``culprit_ranks``, ``message``, ..."""
    return await run_in_threadpool(_incidents, storage, job, kind)


def _trace(storage: Storage, job: str, job_id: int, start: int | None, end: int | None) -> Response:
    check_step_range(start, end)
    truncated = False
    if start is None:
        last = storage.last_step(job_id)
        if last is not None and (end if end is not None else last) - TRACE_MAX_STEPS + 1 > 0:
            start = (end if end is not None else last) - TRACE_MAX_STEPS + 1
            truncated = True
    in_range = {
        rank: stop
        for rank, stop in job_stops(storage, job).items()
        if stop.step is None or (start is None or stop.step >= start) and (end is None or stop.step <= end)
    }
    out = trace_events(job, storage.steps(job_id, start=start, end=end), in_range)
    if truncated:
        out["otherData"]["note"] = f"last {TRACE_MAX_STEPS} steps only; pass ?start=&end= for others"
    return JSONResponse(out)


@router.get("/trace")
async def trace(
    job: str,
    job_id: JobIdDep,
    storage: StorageDep,
    start: Annotated[int | None, Query(description="first step", ge=INT64_MIN, le=INT64_MAX)] = None,
    end: Annotated[int | None, Query(description="last step", ge=INT64_MIN, le=INT64_MAX)] = None,
) -> Response:
    """Chrome/Perfetto trace-event JSON: one process per rank, compute and all-reduce on separate tracks."""
    return await run_in_threadpool(_trace, storage, job, job_id, start, end)
