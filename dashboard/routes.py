"""The dashboard's pages and assets, as one FastAPI router the collector includes.

Handlers only assemble HTML shells; the page scripts fetch ``/api/v1/...`` and draw. The one thing
checked server-side is whether a job exists, so an unknown job gets a real 404 page; that check goes
through the collector's own public API (``internal.get_json``), never around it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from html import escape

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse

from ddpscope.dashboard import assets, internal, plotly_js
from ddpscope.dashboard.shell import api_path, job_href, message_page, render_page

logger = logging.getLogger(__name__)


@asynccontextmanager
async def _lifespan(_app: object) -> AsyncIterator[None]:
    # FastAPI runs an included router's lifespan with the app's: gzip plotly.js once, off the event
    # loop, while the collector starts taking requests.
    plotly_js.start_precompressing()
    yield


router = APIRouter(include_in_schema=False, lifespan=_lifespan)

# Versioned URLs (?v=hash) make long caching safe for our own assets (plotly.js: see plotly_js).
OWN_ASSET_CACHE = "public, max-age=31536000, immutable"


@router.get(plotly_js.PATH)
def plotly_bundle(request: Request) -> Response:
    return plotly_js.response(request)


@router.get("/dashboard-static/{name}")
def own_asset(name: str) -> Response:
    body = assets.own_asset(name)
    if body is None:
        return Response(f"no dashboard asset named {name!r}", status_code=404, media_type="text/plain")
    return Response(body, media_type=assets.content_type(name), headers={"Cache-Control": OWN_ASSET_CACHE})


@router.get("/", response_class=HTMLResponse)
def jobs_page() -> HTMLResponse:
    body = (
        "<h1>Jobs</h1>"
        '<p class="msg" id="message">Loading jobs…</p>'
        '<table id="jobs" class="grid" hidden><thead><tr>'
        "<th>job</th><th>status</th><th>world size</th><th>last seen</th><th>steps</th>"
        "<th>step rate</th><th>flags</th>"
        "</tr></thead><tbody></tbody></table>"
    )
    return HTMLResponse(render_page(title="ddpscope: jobs", body=body, scripts=["jobs.js"]))


async def _unknown_job(request: Request, job: str) -> HTMLResponse | None:
    """A 404 page when the collector has never heard of ``job``; None when it has (or cannot tell)."""
    status, _ = await internal.get_json(request, f"/api/v1/jobs/{job}")
    if status != 404:
        if status != 200:
            # The API is failing: let the page load and show the API's own error instead of guessing.
            logger.warning("GET /api/v1/jobs/%s answered %s; not checking that the job exists", job, status)
        return None
    html = message_page(
        title="Unknown job",
        message=f"The collector has no records for job {job!r}. Check the id, or that the job's "
        "DDPSCOPE_URL points at this collector.",
        crumbs=[(job, None)],
    )
    return HTMLResponse(html, status_code=404)


@router.get("/jobs/{job}", response_class=HTMLResponse)
async def job_page(request: Request, job: str) -> HTMLResponse:
    if (missing := await _unknown_job(request, job)) is not None:
        return missing
    body = f"""
<h1>Job <span class="job-id">{escape(job)}</span> <span id="job-status" class="badge"></span></h1>
<p class="msg" id="message">Loading…</p>
<section class="summary" id="summary"></section>
<nav class="links" id="links">
  <a id="incidents-link" href="{escape(job_href(job, "/incidents"), quote=True)}">incidents</a>
  <span id="step-links"></span>
  <form id="trace-form" class="inline">Perfetto trace of steps
    <input id="trace-start" type="number" min="0" placeholder="start" size="6"> to
    <input id="trace-end" type="number" min="0" placeholder="end" size="6">
    <a id="trace-link" href="#" download>download</a></form>
</nav>
<section><h2>Step time per rank</h2><div id="heatmap" class="plot" hidden></div></section>
<section><h2>Overlap ratio and exposed communication</h2><div id="overlap" class="plot" hidden></div></section>
<section class="cols">
  <div><h2>Stragglers</h2><div id="stragglers" class="plot small" hidden></div>
       <p class="msg" id="stragglers-msg"></p><div id="stall-stacks"></div></div>
  <div><h2>Latest incidents</h2><ul id="incidents" class="incidents"></ul>
       <p class="msg" id="incidents-msg"></p></div>
</section>
<section><h2>Unused parameters</h2><p class="msg" id="unused-msg"></p>
  <table id="unused" class="grid" hidden><thead><tr><th>parameter</th><th>ranks</th><th>steps</th></tr></thead>
  <tbody></tbody></table></section>
<section><h2>Bucket layout</h2><div id="buckets" class="plot small" hidden></div><p class="msg" id="buckets-msg"></p></section>
<section><h2>Memory per rank</h2><div id="memory" class="plot small" hidden></div><p class="msg" id="memory-msg"></p></section>
"""
    page = render_page(
        title=f"ddpscope: {job}",
        body=body,
        scripts=["job.js"],
        data={"job": job},
        crumbs=[(job, None)],
        plotly=True,
    )
    return HTMLResponse(page)


@router.get("/jobs/{job}/steps/{step}", response_class=HTMLResponse)
async def step_page(request: Request, job: str, step: str) -> HTMLResponse:
    if (missing := await _unknown_job(request, job)) is not None:
        return missing
    crumbs: list[tuple[str, str | None]] = [(job, job_href(job)), (f"step {step}", None)]
    if not step.isdigit():
        html = message_page(title="Not a step", message=f"{step!r} is not a step number.", crumbs=crumbs)
        return HTMLResponse(html, status_code=404)
    body = f"""
<h1>Step <span id="step-no">{int(step)}</span> of <a href="{escape(job_href(job), quote=True)}"
  class="job-id">{escape(job)}</a></h1>
<nav class="links" id="step-nav">
  <a id="prev-step" class="disabled">← previous</a>
  <a id="next-step" class="disabled">next →</a>
  <a id="slowest-step" class="disabled">slowest step</a>
  <a id="trace-link" href="#" download>Perfetto trace of this step</a>
</nav>
<p class="msg" id="message">Loading…</p>
<p class="legend">Each rank has two lanes: compute (forward, backward, a tick where each bucket became ready)
and communication (each bucket's all-reduce from launch to end; the exposed tail after the last gradient in red).
Hover for bucket index, bytes and parameters.</p>
<div id="timeline" class="plot tall"></div>
<table id="ranks" class="grid" hidden><thead><tr><th>rank</th><th>step time</th><th>forward</th>
<th>backward</th><th>comm</th><th>exposed comm</th><th>overlap</th></tr></thead><tbody></tbody></table>
"""
    page = render_page(
        title=f"ddpscope: {job} step {int(step)}",
        body=body,
        scripts=["timeline.js"],
        data={"job": job, "step": str(int(step))},
        crumbs=crumbs,
        plotly=True,
        # What timeline.js fetches before it can draw (its main(), same order).
        preload=[api_path(job, f"/timeline?step={int(step)}"), api_path(job, "/buckets"), api_path(job)],
    )
    return HTMLResponse(page)


@router.get("/jobs/{job}/incidents", response_class=HTMLResponse)
async def incidents_page(request: Request, job: str) -> HTMLResponse:
    if (missing := await _unknown_job(request, job)) is not None:
        return missing
    body = f"""
<h1>Incidents of <a href="{escape(job_href(job), quote=True)}" class="job-id">{escape(job)}</a></h1>
<p class="msg" id="message">Loading…</p>
<section id="rank-grid-section" hidden><h2>Ranks</h2><p class="legend">Culprit ranks are marked.</p>
<div id="rank-grid" class="rank-grid"></div></section>
<div id="incident-list"></div>
"""
    page = render_page(
        title=f"ddpscope: {job} incidents",
        body=body,
        scripts=["incidents.js"],
        data={"job": job},
        crumbs=[(job, job_href(job)), ("incidents", None)],
    )
    return HTMLResponse(page)
