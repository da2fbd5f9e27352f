"""``ddpscope serve``: run the collector under uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from ddpscope.server.settings import DEFAULT_DB_URL, DEFAULT_METRICS_RETENTION_S, Settings

logger = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpscope serve",
        description="Run the ddpscope collector: ingest API, analysis API, dashboard and /metrics.",
    )
    p.add_argument(
        "--db",
        default=DEFAULT_DB_URL,
        help="database URL: a SQLite file (default: %(default)s, i.e. ddpscope.db in the current directory) "
        "or postgresql+psycopg://user:password@host/dbname",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8321, help="port (default: %(default)s)")
    p.add_argument(
        "--token",
        default=None,
        help="require 'Authorization: Bearer TOKEN' on ingest (agents: DDPSCOPE_TOKEN)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="allow a non-loopback --host without --token (anyone can write)",
    )
    p.add_argument(
        "--max-body-mb", type=float, default=16.0, help="largest ingest body as sent (default: %(default)s)"
    )
    p.add_argument(
        "--metrics-retention-s",
        type=float,
        default=DEFAULT_METRICS_RETENTION_S,
        help="seconds a finished or failed job stays on /metrics after its last record, so its alerts "
        "can fire and then resolve; running and hung jobs always stay (default: %(default)g)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _check_listen(host: str, port: int) -> None:
    """Bind the address once before the database is opened or created: a port taken by another
    collector is said at once, without leaving a fresh database behind (uvicorn would say it only
    after start-up). Raises ``ValueError``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(
                f"cannot listen on {host}:{port} ({e.strerror}): another collector or service holds it; "
                "stop it or pick another --port"
            ) from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    max_body = int(args.max_body_mb * 1024 * 1024)
    settings = Settings(
        db_url=args.db,
        host=args.host,
        port=args.port,
        token=args.token,
        no_auth=args.no_auth,
        max_body_bytes=max_body,
        max_decompressed_bytes=max(4 * max_body, Settings().max_decompressed_bytes),
        metrics_retention_s=args.metrics_retention_s,
    )
    try:
        settings.check()
        _check_listen(settings.host, settings.port)
    except ValueError as e:
        print(f"ddpscope serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from ddpscope.server.app import create_app
    from ddpscope.server.storage import Storage

    try:
        app = create_app(settings)
        # Opened (and migrated) once here, so a database that cannot be opened is one line, not the
        # traceback of the app's start-up; the app opens its own right after.
        Storage.open(settings.db_url, pool_size=1).close()
    except ValueError as e:
        print(f"ddpscope serve: {e}", file=sys.stderr)
        return 2
    except SQLAlchemyError as e:
        reason = getattr(e, "orig", None) or e
        print(
            f"ddpscope serve: cannot open the database {settings.db_url.split('@')[-1]} ({reason}); "
            "check that its directory exists and is writable, or that the database server is up (--db)",
            file=sys.stderr,
        )
        return 2
    logger.info(
        "ddpscope collector on http://%s:%d (database %s)",
        settings.host,
        settings.port,
        settings.db_url.split("@")[-1],
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0
