"""A real, throwaway PostgreSQL 15 server for tests and benchmarks.

``initdb`` + ``pg_ctl`` into a fresh temp dir on a free port, listening on 127.0.0.1 and on a unix
socket inside the temp dir. ``initdb`` refuses to run as root, so when we are root the server runs as
the system user ``ddpscope-test`` (created if missing, as ``.ci/system-deps`` does) and owns the dir.
Stopping is ``pg_ctl -m immediate`` and then SIGKILL of the postmaster by pid: nothing is left behind.

    with running_postgres() as pg:
        url = pg.create_database("t1")   # postgresql+psycopg://postgres@127.0.0.1:PORT/t1
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import pid_alive

PG_BIN = Path(os.environ.get("DDPSCOPE_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "ddpscope-test"
START_TIMEOUT_S = 60


def available() -> bool:
    return (PG_BIN / "initdb").exists() and (PG_BIN / "pg_ctl").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_user() -> list[str]:
    """Command prefix that runs a PostgreSQL binary as a non-root user when we are root."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            check=True,
            capture_output=True,
        )
    return ["runuser", "-u", PG_USER, "--"]


@dataclass
class PostgresServer:
    root: Path
    port: int
    pid: int | None = None

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create an empty database and return its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """Immediate shutdown (no checkpoint: the data is thrown away), then SIGKILL by pid if needed."""
        with contextlib.suppress(Exception):
            subprocess.run(
                [
                    *_as_user(),
                    str(PG_BIN / "pg_ctl"),
                    "-D",
                    str(self.datadir),
                    "-m",
                    "immediate",
                    "--no-wait",
                    "stop",
                ],
                capture_output=True,
                timeout=30,
            )
        if self.pid is not None:
            deadline = time.monotonic() + 5
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres(*, durable: bool = False) -> PostgresServer:
    """Start a server; ``durable=False`` turns fsync off (tests), True keeps production settings (benchmarks)."""
    if not available():
        raise RuntimeError(f"PostgreSQL binaries not found in {PG_BIN} (set DDPSCOPE_PG_BIN)")
    prefix = _as_user()
    root = Path(tempfile.mkdtemp(prefix="ddpscope-pg-"))
    server = PostgresServer(root=root, port=_free_port())
    try:
        if prefix:
            user = pwd.getpwnam(PG_USER)
            os.chown(root, user.pw_uid, user.pw_gid)
        os.chmod(root, 0o700)
        subprocess.run(
            [
                *prefix,
                str(PG_BIN / "initdb"),
                "-D",
                str(server.datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        opts = f"-p {server.port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        subprocess.run(
            [*prefix, str(PG_BIN / "pg_ctl"), "-D", str(server.datadir), "-o", opts, "-l", str(root / "log"), "-w",
             "-t", str(START_TIMEOUT_S), "start"],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S + 10,
        )  # fmt: skip
        server.pid = int((server.datadir / "postmaster.pid").read_text().split()[0])
        _wait_ready(server)
    except BaseException:
        log = root / "log"
        detail = log.read_text()[-2000:] if log.exists() else ""
        server.stop()
        if isinstance(detail, str) and detail:
            raise RuntimeError(f"PostgreSQL failed to start:\n{detail}") from None
        raise
    return server


def _wait_ready(server: PostgresServer) -> None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            psycopg.connect(
                f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres", connect_timeout=2
            ).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextlib.contextmanager
def running_postgres(*, durable: bool = False) -> Iterator[PostgresServer]:
    server = start_postgres(durable=durable)
    try:
        yield server
    finally:
        server.stop()
