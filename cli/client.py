"""A small JSON client for the collector's HTTP API (stdlib only: the CLI runs on training hosts too)."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8321"


class CollectorError(RuntimeError):
    """The collector could not be reached or answered with an error; the message says which and why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.url = (url or os.environ.get("DDPSCOPE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("DDPSCOPE_TOKEN")
        self.timeout_s = timeout_s

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        return json.loads(self.get_bytes(path + (f"?{query}" if query else "")))

    def get_bytes(self, path: str) -> bytes:
        request = urllib.request.Request(self.url + path)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(detail).get("detail", detail)
            raise CollectorError(f"{self.url}{path}: HTTP {e.code}: {detail}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise CollectorError(
                f"cannot reach the collector at {self.url} ({reason}); start one with `ddpscope serve` "
                "or point --url / DDPSCOPE_URL at it"
            ) from None

    def healthy(self) -> bool:
        try:
            self.get_bytes("/healthz")
            return True
        except CollectorError:
            return False

    def job_path(self, job: str, what: str = "") -> str:
        return f"/api/v1/jobs/{urllib.parse.quote(job, safe='')}" + (f"/{what}" if what else "")

    def items(self, path: str, **params: Any) -> list[dict[str, Any]]:
        return list(self.get(path, **params).get("items", []))
