"""The dashboard's own static files (scripts, stylesheet); plotly.js is ``plotly_js``'s concern."""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import logging

logger = logging.getLogger(__name__)

CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


@functools.cache
def own_asset(name: str) -> bytes | None:
    """One file of ``dashboard/static`` by bare name, or None (names with a path separator never match)."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    res = importlib.resources.files("ddpscope.dashboard") / "static" / name
    return res.read_bytes() if res.is_file() else None


@functools.cache
def version_tag() -> str:
    """A short hash of the dashboard's own assets, appended to their URLs so a new release busts caches."""
    digest = hashlib.sha256()
    static = importlib.resources.files("ddpscope.dashboard") / "static"
    for res in sorted(static.iterdir(), key=lambda r: r.name):
        if res.is_file():
            digest.update(res.name.encode())
            digest.update(res.read_bytes())
    return digest.hexdigest()[:12]


def content_type(name: str) -> str:
    for suffix, ctype in CONTENT_TYPES.items():
        if name.endswith(suffix):
            return ctype
    return "application/octet-stream"
