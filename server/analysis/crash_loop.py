"""A job restarted in place that dies of the same error every time (torchrun ``--max-restarts`` over a bad
sample, a code bug, a missing file): each restart repeats the crash and spends the restart budget, and the
current attempt's error alone does not show that restarting cannot help.

``note_crash_loop`` adds that to the current attempt's ``rank_error`` incidents when an earlier attempt's
processes died of an error of the same type raised at the same user line. Attempts are counted per rank (a
process of each rank per attempt), so an error that moves between ranks is counted at least once per
attempt it ended on some rank: "at least N".

``note_repeated_stop`` does the same for a job that stops without an error of its own at the same place every
attempt: the same collective mismatch, missing collective or hang at the same user line in each attempt's
history (``incidents._before_restart_incidents``, one list per attempt). Pure functions; no database, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpscope.server.analysis.incident_model import Incident, Record, user_frame
from ddpscope.server.analysis.snapshot import JobSnapshot, process_stream


def _signature(error: Record) -> tuple[str, str] | None:
    """(error type, user line) of a fatal error, None when it is not fatal or names no user line."""
    site = user_frame(error.get("stack"))
    if not error.get("fatal") or site is None:
        return None
    return str(error.get("error_type")), site


def note_crash_loop(
    incidents: Sequence[Incident], current: JobSnapshot, previous: JobSnapshot | None
) -> None:
    """Append to each active ``rank_error`` incident of ``current`` how many earlier attempts (in
    ``previous``, ``split_restart``'s older half) ended in the same error at the same line."""
    if previous is None:
        return
    earlier: dict[tuple[str, str], dict[int, set[str]]] = {}
    for e in previous.rank_errors:
        key = _signature(e)
        if key is not None:
            earlier.setdefault(key, {}).setdefault(e["rank"], set()).add(process_stream(str(e.get("stream"))))
    if not earlier:
        return
    for incident in incidents:
        if incident.kind != "rank_error" or not incident.active or incident.rank is None:
            continue
        key = next(
            (
                k
                for e in current.rank_errors
                if e["rank"] == incident.rank and (k := _signature(e)) is not None
            ),
            None,
        )
        by_rank = earlier.get(key) if key is not None else None
        if key is None or not by_rank:
            continue
        attempts = max(len(streams) for streams in by_rank.values())
        error_type, site = key
        incident.message += (
            f" The same error ({error_type} at {site}) also ended {'at least ' if len(by_rank) > 1 else ''}"
            f"{attempts} earlier attempt{'s' if attempts > 1 else ''} of this job: restarting does not get past "
            "it (a bad sample, a missing file, a bug on that line); fix its cause before the next restart, "
            "or stop restarting it (torchrun --max-restarts)."
        )


REPEATING = {"mismatch": "collective mismatch", "missing_collective": "missing collective", "hang": "hang"}
"""The stops a restart meets again when their cause is in the code or the data, and what to call them."""


def note_repeated_stop(incidents: Sequence[Incident], earlier: Sequence[Sequence[Incident]]) -> None:
    """Append to each active incident of ``REPEATING`` kinds how many earlier attempts (``earlier``: each
    attempt's history incidents) stopped with the same kind at the same call site. A hang is noted only
    when no mismatch or missing collective was: the hangs there are that cause's waiting ranks."""
    noted = False
    for kind in REPEATING:  # causes first
        if kind == "hang" and noted:
            break
        for incident in incidents:
            if incident.kind != kind or not incident.active or incident.call_site is None:
                continue
            attempts = sum(
                1 for attempt in earlier
                if any(i.kind == kind and i.call_site == incident.call_site for i in attempt)
            )  # fmt: skip
            if not attempts:
                continue
            noted = True
            incident.message += (
                f" The same {REPEATING[kind]} at {incident.call_site} stopped {attempts} earlier "
                f"attempt{'s' if attempts > 1 else ''} of this job too: restarting does not get past it; fix its "
                "cause before the next restart, or stop restarting it (torchrun --max-restarts)."
            )
