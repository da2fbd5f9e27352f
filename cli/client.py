"""A small JSON client for the collector's HTTP API (stdlib only: the CLI runs on training hosts too)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ddpscope.agent import config
from ddpscope.agent.config import DEFAULT_URL


class CollectorError(RuntimeError):
    """The collector could not be reached or answered with an error; the message says which and why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def url_problem(url: str) -> str | None:
    """What is wrong with a collector base URL, or None: a usage error said before any request."""
    reason = config.url_problem(url)
    if reason is None:
        return None
    return (
        f"--url {url!r} is {reason}: give the collector's base URL, such as {DEFAULT_URL} "
        "(the address `ddpscope serve` prints)"
    )


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.url = (url or os.environ.get("DDPSCOPE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("DDPSCOPE_TOKEN")
        self.timeout_s = timeout_s

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        data = self.get_bytes(path + (f"?{query}" if query else ""))
        try:
            return json.loads(data)
        except ValueError:
            raise self._not_a_collector(path, "200 with a body that is not JSON") from None

    def get_bytes(self, path: str) -> bytes:
        try:
            with self._open(path) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode("utf-8", "replace")
            detail = body
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(body).get("detail", body)
            if e.code == 404 and not self.is_collector(path):
                raise self._not_a_collector(path, f"HTTP 404 ({_snippet(body)})") from None
            raise CollectorError(f"{self.url}{path}: HTTP {e.code}: {detail}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise CollectorError(
                f"cannot reach the collector at {self.url} ({reason}); start one with `ddpscope serve` "
                "or point --url / DDPSCOPE_URL at it"
            ) from None

    def is_collector(self, failed_path: str = "") -> bool:
        """Whether ``GET /api/v1/jobs`` answers like a ddpscope collector (JSON with ``items``).

        Tells "no such job" (a collector's 404 on a job path) from "not a collector at all": a proxy,
        another service or a wrong port answers 404 to every path. Asked only after a 404.
        """
        if failed_path.partition("?")[0] == "/api/v1/jobs":
            return False  # every collector serves the job list
        try:
            with self._open("/api/v1/jobs") as response:
                return isinstance(json.loads(response.read()).get("items"), list)
        except (OSError, ValueError, AttributeError):  # HTTPError and URLError are OSErrors
            return False

    def _open(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(request, timeout=self.timeout_s)

    def _not_a_collector(self, path: str, answer: str) -> CollectorError:
        # status None: the CLI exits as for an unreachable collector (3), not "unknown job" (4).
        return CollectorError(
            f"{self.url} does not look like a ddpscope collector: GET {path} answered {answer}; "
            "point --url / DDPSCOPE_URL at the address `ddpscope serve` prints"
        )

    def healthy(self) -> bool:
        try:
            self.get_bytes("/healthz")
            return True
        except CollectorError:
            return False

    def job_path(self, job: str, what: str = "") -> str:
        return f"/api/v1/jobs/{urllib.parse.quote(job, safe='')}" + (f"/{what}" if what else "")

    def page(self, path: str, **params: Any) -> dict[str, Any]:
        """A list endpoint's whole answer: ``items`` and what the collector says beside them (``advice``)."""
        data = self.get(path, **params)
        if not isinstance(data, dict):
            raise self._not_a_collector(path, "JSON without an item list")
        return data

    def items(self, path: str, **params: Any) -> list[dict[str, Any]]:
        return list(self.page(path, **params).get("items", []))


def _snippet(body: str) -> str:
    """A proxy's HTML error page or JSON body, as a short printable fragment."""
    text = " ".join(re.sub(r"<[^>]*>|[\x00-\x1f\x7f-\x9f]", " ", body).split())
    return (text[:80] + "...") if len(text) > 80 else (text or "empty body")
