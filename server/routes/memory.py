"""The ranks' memory over time (``analysis/memory.py``): what the job page charts beside the leak incident."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool

from ddpscope.server.analysis.memory import memory_report
from ddpscope.server.deps import JobIdDep, StorageDep
from ddpscope.server.routes._items import items
from ddpscope.server.storage import Storage

router = APIRouter(prefix="/api/v1/jobs/{job}", tags=["memory"])


def _memory(storage: Storage, job: str, job_id: int) -> Response:
    lifecycle = storage.fetch_records(job, ["rank_start", "rank_exit"])  # one query, both kinds
    starts = [r for r in lifecycle if r["kind"] == "rank_start"]
    exits = [r for r in lifecycle if r["kind"] == "rank_exit"]
    return items(memory_report(storage.memory_window(job_id), starts, exits))


@router.get("/memory")
async def get_memory(job: str, job_id: JobIdDep, storage: StorageDep) -> Response:
    """Per rank: ``rank``, ``host``, its latest ``rss_bytes``, ``available_bytes`` and ``total_bytes`` (the
    host's, or its memory cgroup's when that limit is lower), ``workers_bytes`` (its DataLoader workers' own
    memory, null without workers), ``growing``, ``growing_in`` (``rank`` or ``workers``) and ``bytes_per_min``
    (the ``memory_growth`` test, over its latest attempt), and ``samples``
    ``[time_s, step, rss_bytes, available_bytes, workers_bytes]`` over the last hour of records (one every
    30 s). Empty for agents that send no ``memory`` records (older ones, not Linux)."""
    return await run_in_threadpool(_memory, storage, job, job_id)
