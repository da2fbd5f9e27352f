"""The collector's FastAPI application: ``create_app(settings)``.

Nothing happens at import time: the lifespan opens storage (creating or migrating the schema) and
builds the /metrics registry; state lives on ``app.state`` (``settings``, ``storage``, ``registry``,
``ingest_gate``). The dashboard's router is included when ``ddpscope.dashboard`` provides one.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from ddpscope.server.gate import IngestGate
from ddpscope.server.metrics import make_registry
from ddpscope.server.routes import health, incidents, ingest, jobs, memory, steps
from ddpscope.server.settings import Settings
from ddpscope.server.storage import Storage

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    settings.check()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        storage = await run_in_threadpool(Storage.open, settings.db_url, pool_size=settings.pool_size)
        app.state.storage = storage
        app.state.registry = make_registry(storage, retention_s=settings.metrics_retention_s)
        try:
            yield
        finally:
            await run_in_threadpool(storage.flush_counts)
            storage.close()

    app = FastAPI(title="ddpscope collector", version="1", lifespan=lifespan)
    app.state.settings = settings
    app.state.ingest_gate = IngestGate(settings.max_pending_ingest)
    for module in (ingest, health, jobs, steps, incidents, memory):
        app.include_router(module.router)
    _include_dashboard(app)
    return app


def _include_dashboard(app: FastAPI) -> None:
    try:
        dashboard = importlib.import_module("ddpscope.dashboard")
    except ModuleNotFoundError as e:
        if e.name != "ddpscope.dashboard":
            raise
        return
    router = getattr(dashboard, "router", None)
    if router is None:
        logger.info("ddpscope.dashboard has no router yet: serving the API only")
        return
    app.include_router(router)
    static_dir = getattr(dashboard, "STATIC_DIR", None)
    if static_dir is not None and Path(static_dir).is_dir():
        from fastapi.staticfiles import StaticFiles

        app.mount("/static", StaticFiles(directory=str(static_dir)), name="static")
