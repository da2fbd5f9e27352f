"""The HTML shell every page shares. Everything that comes from data is escaped here, server-side.

Pages are small: a header, a ``<main>`` whose ``data-*`` attributes tell the page script what to fetch
(job id, step), placeholders the script fills with ``textContent`` and Plotly, and the script tags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from urllib.parse import quote

from ddpscope.dashboard import plotly_js
from ddpscope.dashboard.assets import version_tag

URI_COMPONENT_SAFE = "!*'()"
"""What JavaScript's ``encodeURIComponent`` leaves unescaped beyond what ``quote`` always does."""


def job_href(job: str, suffix: str = "") -> str:
    """URL of a job page; the id is percent-encoded so any string round-trips as one path segment."""
    return f"/jobs/{quote(job, safe='')}{suffix}"


def api_path(job: str, suffix: str = "") -> str:
    """An API URL exactly as the page scripts spell it (``ddp.jobPath``: ``encodeURIComponent``, which
    also leaves ``!*'()`` alone), so a ``<link rel=preload>`` of it is the very request the script makes."""
    return f"/api/v1/jobs/{quote(job, safe=URI_COMPONENT_SAFE)}{suffix}"


def asset_url(name: str) -> str:
    return f"/dashboard-static/{name}?v={version_tag()}"


def render_page(
    *,
    title: str,
    body: str,
    scripts: Sequence[str] = (),
    data: Mapping[str, str] | None = None,
    crumbs: Sequence[tuple[str, str | None]] = (),
    plotly: bool = False,
    preload: Sequence[str] = (),
) -> str:
    """A whole HTML document. ``body`` is trusted markup built by this package; ``title``, ``data`` values
    and breadcrumb labels are raw strings and are escaped here. ``preload``: API paths (``api_path``) the
    page script will fetch first; the browser starts them while it parses the head."""
    attrs = "".join(f' data-{escape(k)}="{escape(v, quote=True)}"' for k, v in (data or {}).items())
    nav = ['<a href="/">ddpscope</a>']
    for label, href in crumbs:
        nav.append(
            f'<a href="{escape(href, quote=True)}">{escape(label)}</a>'
            if href
            else f"<span>{escape(label)}</span>"
        )
    # The first figure waits for two things that can overlap: the API data and plotly.js (4.8 MB that
    # V8 compiles on a background thread as it streams in). So the data requests go out first, as
    # preloads the browser issues while parsing the head (the page script's fetch() then takes the
    # preloaded response), and every script is in the head, deferred, page scripts before plotly: they
    # run as soon as the document is parsed, and draw only after ``ddp.plotlyReady``.
    links = [
        f'<link rel="preload" as="fetch" crossorigin="anonymous" href="{escape(p, quote=True)}">'
        for p in preload
    ]
    tags = [f'<script defer src="{asset_url(s)}"></script>' for s in ("common.js", *scripts)]
    if plotly:
        tags.append(f'<script defer src="{plotly_js.url()}"></script>')
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title>"
        f"{''.join(links)}"
        f'<link rel="icon" href="data:,"><link rel="stylesheet" href="{asset_url("style.css")}">'
        f"{''.join(tags)}"
        "</head><body>"
        f"<header><nav>{' / '.join(nav)}</nav></header>"
        f'<main id="app"{attrs}>{body}</main>'
        "</body></html>\n"
    )


def message_page(*, title: str, message: str, crumbs: Sequence[tuple[str, str | None]] = ()) -> str:
    """A page that only says something (unknown job, bad step number)."""
    return render_page(
        title=title,
        body=f'<h1>{escape(title)}</h1><p class="msg" id="message">{escape(message)}</p>',
        crumbs=crumbs,
    )
