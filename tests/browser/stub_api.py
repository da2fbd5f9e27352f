"""A stand-in for the collector's read API, fed from ``fixtures/*.json``: the dashboard router mounted
next to endpoints that answer exactly what the fixture files say. Used for the router's own HTTP tests
(escaping, 404 pages) where the data must be hostile on purpose; the browser tests use the real collector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException

from ddpscope.dashboard import router

FIXTURES = Path(__file__).parent / "fixtures"
HOSTILE_JOB = "demo<img src=x onerror=alert(1)>\"'&"


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def stub_app() -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    known = {j["job"] for j in fixture("jobs")["items"]}

    def need(job: str) -> bool:
        if job not in known:
            raise HTTPException(404, f"unknown job {job!r}")
        return job == HOSTILE_JOB  # the other fixture job has no data at all

    @app.get("/api/v1/jobs")
    def jobs() -> Any:
        return fixture("jobs")

    @app.get("/api/v1/jobs/{job}")
    def job(job: str) -> Any:
        need(job)
        return next(j for j in fixture("jobs")["items"] if j["job"] == job)

    @app.get("/api/v1/jobs/{job}/steps")
    def steps(
        job: str,
        rank: int | None = None,
        start: int | None = None,
        end: int | None = None,
        limit: int = 10000,
    ) -> Any:
        items = fixture("steps")["items"] if need(job) else []
        items = [
            i
            for i in items
            if (rank is None or i["rank"] == rank)
            and (start is None or i["step"] >= start)
            and (end is None or i["step"] < end)
        ]
        return {"items": items[:limit]}

    @app.get("/api/v1/jobs/{job}/timeline")
    def timeline(job: str, step: int) -> Any:
        if need(job) and (FIXTURES / f"timeline_{step}.json").exists():
            return fixture(f"timeline_{step}")
        raise HTTPException(404, f"no records of step {step}")

    for name, path in (
        ("buckets", "buckets"),
        ("stragglers", "stragglers"),
        ("unused", "unused-parameters"),
        ("incidents", "incidents"),
    ):

        def endpoint(job: str, _name: str = name) -> Any:
            return fixture(_name) if need(job) else {"items": []}

        app.add_api_route(f"/api/v1/jobs/{{job}}/{path}", endpoint, methods=["GET"])
    return app
