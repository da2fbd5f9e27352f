"""A ``file://`` rendezvous left over from an earlier run, read from the error of a rank that used it.

torch's ``FileStore`` requires a file that does not exist yet. A run that ended without
``destroy_process_group`` (a crash, a kill, ``os._exit``) leaves it behind, and the next run's ranks read
that run's peer addresses from it: gloo's connect is refused (no process listens there any more), and
nothing else in the job says why. The agent sends, with an error of ``init_process_group``, the file's
last write before the call and when its process started (``ddp/store_file.py``). A file written before the
process started, and a connection refused: the address read from it is an earlier run's. (A peer of this
run launched earlier also writes the file before this process starts, but it listens where it wrote, so
the connection to it is not refused; a peer that died after writing is named by its own death first.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone

from ddpscope.server.analysis.incident_model import Record
from ddpscope.server.analysis.restart_race import refused_address
from ddpscope.server.analysis.snapshot import JobSnapshot

SLACK_S = 1.0
"""How much earlier than its process's start a file may seem written (clocks of a shared file system)."""

ADVICE = (
    "Delete the file before each launch, or give each run a path of its own (the job id in its name); "
    "torch removes it only when every rank calls destroy_process_group"
)


def leftover_store_file(failed: Sequence[Record], snapshot: JobSnapshot) -> str | None:
    """Why ``failed`` (errors of ranks waiting for a peer) could not connect, when one of them was refused
    in ``init_process_group`` on a ``file://`` rendezvous written before its process started; else None."""
    refused = {v["rank"]: ":".join(address) for v in failed if (address := refused_address(v)) is not None}
    # The error as init_process_group raised it carries the file; the same exception said again as it
    # ends the process (by the agent's last-resort hook, before ddpscope's own are installed) does not.
    for v in snapshot.rank_errors:
        found = v.get("store_file")
        if (
            v["rank"] not in refused
            or not isinstance(found, Mapping)
            or found.get("process_started_ns") is None
        ):
            continue
        before_s = (int(found["process_started_ns"]) - int(found["mtime_ns"])) / 1e9
        if before_s <= SLACK_S:
            continue
        written = datetime.fromtimestamp(int(found["mtime_ns"]) / 1e9, timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC"
        )
        return (
            f"the cause is the rendezvous file: rank {v['rank']} called init_process_group with init_method "
            f"file://{found['path']}, a file last written at {written}, {_span(before_s)} before its process "
            f"started, and the peer address it read there ({refused[v['rank']]}) refused the connection. torch's "
            "FileStore needs a file that does not exist yet; this one is an earlier run's (one that ended "
            "without destroy_process_group: a crash, a kill, os._exit), and no process listens at its "
            f"addresses any more. {ADVICE}"
        )
    return None


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
