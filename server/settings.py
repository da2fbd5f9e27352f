"""Collector settings: one dataclass, filled from the command line (``serve.py``) or by tests."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DEFAULT_DB_URL = "sqlite:///ddpscope.db"

DEFAULT_METRICS_RETENTION_S = 900.0
"""15 minutes: long enough for a failed job to fire its alerts (DDPRankSilent needs 60 s of silence
plus a few 15 s scrapes), short enough that they resolve the same quarter of an hour."""

MIN_METRICS_RETENTION_S = 120.0
"""Below this an ended job can leave /metrics before DDPRankSilent (60 s of silence) had the scrapes
it needs to fire, so a job that failed between two looks would never page."""


@dataclass(kw_only=True, slots=True)
class Settings:
    db_url: str = DEFAULT_DB_URL
    """SQLAlchemy URL: ``sqlite:///path`` (default: ddpscope.db in the current directory) or
    ``postgresql+psycopg://user@host/db``."""
    host: str = "127.0.0.1"
    port: int = 8321
    token: str | None = None
    """When set, ingest needs ``Authorization: Bearer <token>``."""
    no_auth: bool = False
    """Allow a non-loopback host without a token (explicit opt-out)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted, as sent (compressed)."""
    max_decompressed_bytes: int = 64 * 1024 * 1024
    """Largest body after gzip decompression; inflating stops there (a gzip bomb never inflates fully)."""
    max_pending_ingest: int = 32
    """Ingest requests decoding or waiting for the database at once; more get 429 with Retry-After."""
    retry_after_s: int = 1
    pool_size: int = 8
    """Database connections for reads (and for writes on PostgreSQL)."""
    metrics_retention_s: float = DEFAULT_METRICS_RETENTION_S
    """How long an ended job (finished or failed) stays on /metrics after its newest record, by the
    collector's clock. Running and hung jobs always stay."""

    def check(self) -> None:
        """Raise ``ValueError`` (message names the option) for an unsafe or impossible configuration."""
        if self.token is not None and not self.token.strip():
            raise ValueError("--token: an empty token would accept anyone; give a real one or omit --token")
        if not is_loopback(self.host) and self.token is None and not self.no_auth:
            raise ValueError(
                f"--host {self.host} is reachable from other machines but no --token is set: anyone could "
                "write to this collector. Pass --token T (agents set DDPSCOPE_TOKEN=T) or --no-auth to "
                "accept that."
            )
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: a TCP port is 1 to 65535")
        _check_db_url(self.db_url)
        if self.max_body_bytes <= 0 or self.max_decompressed_bytes < self.max_body_bytes:
            raise ValueError("max_body_bytes must be > 0 and max_decompressed_bytes >= max_body_bytes")
        if self.max_pending_ingest < 1:
            raise ValueError("max_pending_ingest must be >= 1")
        if not self.metrics_retention_s >= MIN_METRICS_RETENTION_S:  # `not >=` also refuses NaN
            raise ValueError(
                f"--metrics-retention-s {self.metrics_retention_s:g}: must be at least "
                f"{MIN_METRICS_RETENTION_S:g} s, or a job that failed between scrapes leaves /metrics "
                "before DDPRankSilent (60 s of silence) can fire"
            )


def _check_db_url(url: str) -> None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        raise ValueError(
            f"--db {url!r} is not a database URL; use sqlite:///path/to/file.db or "
            "postgresql+psycopg://user:password@host/dbname"
        ) from None
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"--db: unsupported database {backend!r}; use sqlite:/// or postgresql+psycopg://")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere
