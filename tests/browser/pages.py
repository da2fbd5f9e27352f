"""Helpers for driving dashboard pages in the browser tests: URLs, waits, and reading Plotly figures."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

WAIT_MS = 90_000
"""Generous: other engineers' tests share the two cores (load averages of 15 were seen), and plotly.js
then takes many seconds to compile. Waits end as soon as the page is ready, so this costs nothing
when the machine is quiet."""


def job_url(base: str, job: str, suffix: str = "") -> str:
    return f"{base}/jobs/{quote(job, safe='')}{suffix}"


def open_job_list(page: Any, base: str) -> Any:
    resp = page.goto(base + "/", wait_until="commit")
    page.wait_for_function("window.ddpJobListUpdates >= 1", timeout=WAIT_MS)
    return resp


def open_job(page: Any, base: str, job: str) -> Any:
    resp = page.goto(job_url(base, job), wait_until="commit")
    page.wait_for_function("window.ddpJobUpdates >= 1", timeout=WAIT_MS)
    return resp


def open_step(page: Any, base: str, job: str, step: int | str) -> Any:
    resp = page.goto(job_url(base, job, f"/steps/{step}"), wait_until="commit")
    page.wait_for_function("window.ddpTimelineComplete === true || window.ddpTimelineRendered !== undefined && "
                           "document.getElementById('message').textContent.startsWith('Step')", timeout=WAIT_MS)  # fmt: skip
    return resp


def open_incidents(page: Any, base: str, job: str) -> Any:
    resp = page.goto(job_url(base, job, "/incidents"), wait_until="commit")
    page.wait_for_function("window.ddpIncidentUpdates >= 1", timeout=WAIT_MS)
    return resp


def figure(page: Any, div_id: str) -> dict[str, Any]:
    """The data and layout Plotly holds for the graph div ``div_id`` (what is actually drawn)."""
    return page.evaluate(
        """(id) => { const d = document.getElementById(id);
           return d && d.data ? { data: d.data, layout: { yaxis: d.layout.yaxis, annotations: d.layout.annotations || [] } } : null; }""",
        div_id,
    )


def timeline_kinds(page: Any) -> dict[str, dict[str, Any]]:
    """The step timeline's hover traces by kind: ``segments`` drawn, and hover ``x``, ``y``, ``text``."""
    fig = figure(page, "timeline")
    assert fig is not None, "the timeline figure was not drawn"
    return {t["meta"]["kind"]: {"segments": t["meta"]["segments"], "x": t["x"], "y": t["y"], "text": t["text"]}
            for t in fig["data"] if t.get("meta")}  # fmt: skip


def text(page: Any, selector: str) -> str:
    return str(page.locator(selector).inner_text())
