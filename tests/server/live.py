"""A real collector process on loopback: ``ddpscope serve`` in a subprocess with a start-up deadline,
killed by its process group at the end (never by name). Reusable by other test suites::

    with live_collector(f"sqlite:///{tmp_path}/c.db") as url:
        httpx.get(f"{url}/healthz")
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx

from tests.support.procs import free_port, kill_group

START_DEADLINE_S = 30.0


@contextlib.contextmanager
def live_collector(db_url: str, *, args: Sequence[str] = (), port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "ddpscope.cli.main",
        "serve",
        "--port",
        str(port),
        "--db",
        db_url,
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"collector exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"collector did not answer /healthz within {START_DEADLINE_S} s")
            time.sleep(0.1)
        yield url
    finally:
        kill_group(proc)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=10)
