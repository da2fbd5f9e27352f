"""A ``file://`` rendezvous whose file was written before this process started: an earlier run's.

``init_process_group(init_method="file:///path")`` keeps the rendezvous in that file (torch's
``FileStore``), which torch requires not to exist beforehand: a run that ended without
``destroy_process_group`` (a crash, ``os._exit``, a kill) leaves it behind, and the next run's ranks read
that run's peer addresses from it and fail to connect ("Connection refused"). Read before the call (a
stat, only for ``file://``): the file's path, when it was last written, and when this process started;
sent with the error if the call fails. The collector says it (``analysis/store_file.py``) only for a
connection refused: a peer of this run launched earlier writes the file before this process starts too,
but it listens where it wrote, so connecting to it succeeds.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import unquote, urlparse

SCHEME = "file://"


def existing(init_method: Any) -> dict[str, Any] | None:
    """``{"path", "mtime_ns", "process_started_ns"}`` when ``init_method`` is a ``file://`` URL whose file
    exists; None otherwise. Never raises."""
    if not isinstance(init_method, str) or not init_method.startswith(SCHEME):
        return None
    try:
        path = unquote(urlparse(init_method).path)
        return {
            "path": path[:1000],
            "mtime_ns": os.stat(path).st_mtime_ns,
            "process_started_ns": process_started_ns(),
        }
    except (OSError, ValueError):
        return None


def process_started_ns() -> int | None:
    """When this process started (wall clock, ns) from ``/proc``; None where there is none. Its age is
    read on the boot-time clock (``/proc/stat``'s boot time is whole seconds; this is the tick's 10 ms)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22, starttime, in clock ticks since boot; the name (field 2) may hold spaces and ")".
            after_name = f.read().rsplit(b")", 1)[1].split()
        started_s = int(after_name[19]) / os.sysconf("SC_CLK_TCK")
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
        return time.time_ns() - int(age_s * 1e9)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
