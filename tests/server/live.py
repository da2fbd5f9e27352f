"""A real collector process on loopback, as a context manager yielding its URL::

    with live_collector(f"sqlite:///{tmp_path}/c.db") as url:
        httpx.get(f"{url}/healthz")

A thin shape over ``tests.support.collector_proc.CollectorProc`` (start-up deadline, killed by its
process group at the end, never by name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from tests.support.collector_proc import CollectorProc

START_DEADLINE_S = 60.0
"""A hang guard, not a speed check: on a 2-core machine busy with another stream's ranks a collector's imports
alone can take tens of seconds (~1.6 s of CPU)."""


@contextlib.contextmanager
def live_collector(db_url: str, *, args: Sequence[str] = (), port: int | None = None) -> Iterator[str]:
    with CollectorProc(db_url, port=port, extra_args=args) as proc:
        proc.start(timeout_s=START_DEADLINE_S)
        yield proc.url
