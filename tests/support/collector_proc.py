"""A real collector process (``python -m ddpscope.cli.main serve``) that tests start, SIGKILL and restart.

    with CollectorProc(db_url, log_path=tmp_path / "collector.log") as c:
        c.start()            # waits for GET /healthz == 200 (deadline), returns the base URL
        c.kill()             # SIGKILL by pid (its own session), reaped
        c.start()            # same port, same database

The port is chosen once, so agents keep their ``DDPSCOPE_URL`` across restarts. The process runs in
its own session and is killed by its pid / process group only, never by name; leaving the ``with``
block kills it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tests.support.procs import free_port


class CollectorProc:
    def __init__(
        self,
        db_url: str,
        *,
        port: int | None = None,
        token: str | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
    ) -> None:
        self.db_url = db_url
        self.port = port or free_port()
        self.token = token
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kills = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> CollectorProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def start(self, timeout_s: float = 60.0) -> str:
        """Start the collector and wait until ``/healthz`` answers 200; raise (after killing it) if not. The
        deadline guards against a hang, not a slow start: on a busy 2-core machine imports alone take seconds."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("collector already running")
        cmd = [
            sys.executable,
            "-m",
            "ddpscope.cli.main",
            "serve",
            "--port",
            str(self.port),
            "--db",
            self.db_url,
        ]
        cmd += ["--log-level", "warning", *self.extra_args]
        if self.token:
            cmd += ["--token", self.token]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                return self.url
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"collector not healthy within {timeout_s} s: {self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=1.0) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def kill(self) -> None:
        """SIGKILL the collector (its process group, by pid) and reap it."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)
        self.kills += 1

    def rss_kb(self, field: str = "VmRSS") -> int:
        """``VmRSS`` (or ``VmHWM``, the peak) of the running collector, in kB, from /proc."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise LookupError(field)

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
