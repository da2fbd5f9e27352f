"""Read the collector's JSON API from inside the same process, through the app itself.

The dashboard depends on the public API only (the DESIGN.md table), not on the server's storage or
analysis modules: a page handler that needs data calls ``get_json(request, "/api/v1/jobs")``, which runs
the request through the ASGI app exactly as a browser's fetch would, without a socket.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.types import Message

logger = logging.getLogger(__name__)


async def get_json(request: Request, path: str, query: str = "") -> tuple[int, Any]:
    """GET ``path`` on the app serving ``request``; return ``(status, parsed JSON or None)``."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": request.scope.get("scheme", "http"),
        "path": path,
        "raw_path": quote(path).encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [
            (b"host", request.headers.get("host", "localhost").encode()),
            (b"accept", b"application/json"),
        ],
        "client": request.scope.get("client"),
        "server": request.scope.get("server"),
        "app": request.app,
    }
    if "state" in request.scope:
        # Lifespan state (the collector's storage handle may live there) must reach the inner request.
        scope["state"] = request.scope["state"]
    status = 500
    chunks: list[bytes] = []
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await request.app(scope, receive, send)
    except Exception:
        # Starlette re-raises a route's exception after answering 500; the page must still render
        # (its script then shows the API's error), so the failure is logged here, not propagated.
        logger.exception("internal GET %s failed", path)
        return 500, None
    body = b"".join(chunks)
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        logger.warning("GET %s answered %s with a body that is not JSON", path, status)
        return status, None
