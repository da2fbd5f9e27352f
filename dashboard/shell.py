"""The HTML shell every page shares. Everything that comes from data is escaped here, server-side.

Pages are small: a header, a ``<main>`` whose ``data-*`` attributes tell the page script what to fetch
(job id, step), placeholders the script fills with ``textContent`` and Plotly, and the script tags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from urllib.parse import quote

from ddpscope.dashboard.assets import version_tag

PLOTLY_URL = "/static/plotly.min.js"
"""Where the collector serves plotly.js (the router serves it there too, see ``routes``)."""


def job_href(job: str, suffix: str = "") -> str:
    """URL of a job page; the id is percent-encoded so any string round-trips as one path segment."""
    return f"/jobs/{quote(job, safe='')}{suffix}"


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
) -> str:
    """A whole HTML document. ``body`` is trusted markup built by this package; ``title``, ``data`` values
    and breadcrumb labels are raw strings and are escaped here."""
    attrs = "".join(f' data-{escape(k)}="{escape(v, quote=True)}"' for k, v in (data or {}).items())
    nav = ['<a href="/">ddpscope</a>']
    for label, href in crumbs:
        nav.append(
            f'<a href="{escape(href, quote=True)}">{escape(label)}</a>'
            if href
            else f"<span>{escape(label)}</span>"
        )
    # All deferred, page scripts first: they start their API fetches at once, and those run on the
    # network while the browser is still evaluating plotly.js (seconds on a slow machine); the scripts
    # draw only after ``ddp.plotlyReady``.
    tags = [f'<script defer src="{asset_url(s)}"></script>' for s in ("common.js", *scripts)]
    if plotly:
        tags.append(f'<script defer src="{PLOTLY_URL}"></script>')
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title>"
        f'<link rel="icon" href="data:,"><link rel="stylesheet" href="{asset_url("style.css")}">'
        "</head><body>"
        f"<header><nav>{' / '.join(nav)}</nav></header>"
        f'<main id="app"{attrs}>{body}</main>'
        f"{''.join(tags)}"
        "</body></html>\n"
    )


def message_page(*, title: str, message: str, crumbs: Sequence[tuple[str, str | None]] = ()) -> str:
    """A page that only says something (unknown job, bad step number)."""
    return render_page(
        title=title,
        body=f'<h1>{escape(title)}</h1><p class="msg" id="message">{escape(message)}</p>',
        crumbs=crumbs,
    )
