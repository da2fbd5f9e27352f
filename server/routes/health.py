"""``/healthz`` (the database answers, and took the last write) and ``/metrics`` (Prometheus exposition, read at scrape time)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ddpscope.server.deps import StorageDep

logger = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(storage: StorageDep) -> dict[str, str]:
    try:
        ok = await run_in_threadpool(storage.ping)
    except Exception as e:  # any driver error means "not healthy", reported, not raised
        logger.warning("health check failed: %s", e)
        ok = False
    if not ok:
        raise HTTPException(503, "database does not answer; check --db and that the database is up")
    problem = storage.engines.file_problem()
    if problem is not None:
        raise HTTPException(503, problem)
    failure = storage.write_failure
    if failure is not None:
        # It answers reads but refuses writes (a full disk, a lock held elsewhere): ingest fails.
        raise HTTPException(
            503,
            f"the database answers but refused the last write {time.time() - failure[0]:.0f} s ago "
            f"({failure[1]}); ingest fails until a write succeeds: free disk space or release the lock",
        )
    return {"status": "ok", "database": storage.dialect}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(generate_latest, request.app.state.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
