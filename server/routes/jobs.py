"""``/api/v1/jobs``: every job the collector has heard of, with status and progress."""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.concurrency import run_in_threadpool

from ddpscope.server.analysis.jobs import rank_table, summarize
from ddpscope.server.analysis.status import job_status
from ddpscope.server.deps import StorageDep
from ddpscope.server.routes._items import item
from ddpscope.server.storage import JobRow, Storage

router = APIRouter(prefix="/api/v1", tags=["jobs"])


def _summary(
    storage: Storage, row: JobRow, now_s: float, *, with_ranks: bool = False
) -> dict[str, Any] | None:
    snap = storage.load_snapshot(row.job)
    if snap is None:
        return None
    out = item(summarize(snap, row.first_seen_ns / 1e9, job_status(snap, now_s)))
    if with_ranks:
        out["ranks"] = rank_table(snap)
    return out


def _all(storage: Storage) -> dict[str, Any]:
    now_s = time.time()
    out = [_summary(storage, row, now_s) for row in storage.jobs()]
    return {"items": [s for s in out if s is not None]}


@router.get("/jobs")
async def list_jobs(storage: StorageDep) -> dict[str, Any]:
    """Jobs, most recently seen first: ``job``, ``world_size``, ``status``, ``last_seen``, ``steps``, ``step_rate``."""
    return await run_in_threadpool(_all, storage)


@router.get("/jobs/{job}")
async def get_job(job: str, storage: StorageDep) -> dict[str, Any]:
    """One job's summary plus ``ranks``: each rank's ``host``, ``pid``, engine, backend, versions and
    clock estimate, from its latest ``rank_start``."""
    row = await run_in_threadpool(storage.job_row, job)
    if row is None:
        raise HTTPException(404, f"job {job!r} not found: no record of it reached this collector")
    summary = await run_in_threadpool(functools.partial(_summary, with_ranks=True), storage, row, time.time())
    if summary is None:
        raise HTTPException(404, f"job {job!r} not found")
    return summary
