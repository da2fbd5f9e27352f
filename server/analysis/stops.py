"""Where each rank stopped: the step it hung or failed in, as far as it got, or how it left the job.

A rank sends its step record at the end of backward, so the step a job hung or crashed in has no
step records: the one step a post-mortem wants to see. The rank's hang and error reports carry that
step so far (``partial_step``: forward, backward and each bucket's ready, launch and end times, 0 for
what had not happened), and this module reads them, with the exit reports, into one ``Stop`` per rank
for the timeline and the trace to draw.

The reports read are those of each rank's current incarnation (``Storage.stop_reports``), oldest first.
A hang the rank resolved (it made progress again) is no stop. A rank that hung and then failed (a
collective timeout raised after the hang) or was stopped (SIGTERM from its scheduler) stopped where it
hung: the later report says how it ended, the partial step comes from the newest report that had one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ddpscope.server.analysis.incident_model import known_phase
from ddpscope.server.rows import StepRow

HUNG, FAILED, EXITED = "hung", "failed", "exited"


@dataclass(slots=True)
class Stop:
    rank: int
    state: str
    """``hung`` (a hang report, never resolved), ``failed`` (an error report) or ``exited`` (the rank left:
    finished, SIGTERM, SIGINT)."""
    step: int | None
    phase: str | None
    time_ns: int
    """When the newest report was written: the right end of the unfinished step's open spans."""
    message: str
    partial: StepRow | None
    """The unfinished step, as far as the rank got (times of 0 had not happened)."""

    @property
    def until_ns(self) -> int:
        """The right end of the unfinished step's open spans: the report's time, never before the step."""
        return max(self.time_ns, self.partial.forward_start_ns) if self.partial is not None else self.time_ns


def _partial_row(rank: int, wire: Mapping[str, Any]) -> StepRow:
    return StepRow(
        rank=rank,
        step=int(wire["step"]),
        synced=bool(wire["synced"]),
        forward_start_ns=int(wire["forward_start_ns"]),
        forward_end_ns=int(wire["forward_end_ns"]),
        backward_start_ns=int(wire["backward_start_ns"]),
        backward_end_ns=0,
        bucket_ready_ns=list(wire["bucket_ready_ns"]),
        allreduce_start_ns=list(wire["allreduce_start_ns"]),
        allreduce_end_ns=list(wire["allreduce_end_ns"]),
        bucket_bytes=list(wire["bucket_bytes"]),
        ready_order=[],
        collective_seqs=[],
    )


def _exit_words(reason: str) -> str:
    return {
        "finished": "finished its loop and exited",
        "sigterm": "was stopped by SIGTERM",
        "sigint": "was stopped by SIGINT or an uncaught KeyboardInterrupt",
        "error": "exited on an error",
    }.get(reason, f"exited ({reason})")


def stops(
    reports: Iterable[Mapping[str, Any]], last_seen_ns: Mapping[int, int] | None = None
) -> dict[int, Stop]:
    """Each rank's stop, from its ``hang``, ``hang_resolved``, ``rank_error`` and ``rank_exit`` reports
    (oldest first). A rank still running normally has none. ``last_seen_ns``: each rank's newest record
    of any kind; a hung rank heard from after its report (heartbeats) was still stuck then, as a
    resolved hang would have come first, so its open spans reach that time."""
    out: dict[int, Stop] = {}
    for r in reports:
        rank, kind = int(r["rank"]), r["kind"]
        before = out.get(rank)
        if kind == "hang_resolved":
            if before is not None and before.state == HUNG:
                del out[rank]
            continue
        partial = r.get("partial_step")
        row = _partial_row(rank, partial) if partial else (before.partial if before else None)
        if kind == "rank_exit":
            words = _exit_words(str(r.get("reason")))
            if before is not None and before.state != EXITED:
                # How a hung or failed rank ended: it stays where it stopped.
                before.message = f"{before.message} (then it {words})"
                before.time_ns = max(before.time_ns, int(r["time_ns"]))
                continue
            state, message = EXITED, f"it {words}"
        elif kind == "rank_error":
            state = FAILED
            message = f"{r.get('error_type')}: {r.get('message')}"
        elif kind == "hang":
            if before is not None and before.state == FAILED:
                continue  # a failed rank's watchdog may still report it stalled: the failure explains it
            state, message = HUNG, str(r.get("message", ""))
        else:
            continue
        step = r.get("step")
        inherited = not partial and before is not None and row is not None
        out[rank] = Stop(
            rank=rank,
            state=state,
            step=None if step is None else int(step),
            # A later report without the partial step (the same error again as it ends the process) keeps
            # the phase the partial step was taken in.
            phase=before.phase if inherited and before is not None else known_phase(r.get("phase")),
            time_ns=int(r["time_ns"]),
            message=message,
            partial=row if row is not None and (step is None or row.step == step) else None,
        )
    for stop in out.values():
        if stop.state == HUNG and last_seen_ns:
            stop.time_ns = max(stop.time_ns, last_seen_ns.get(stop.rank, 0))
    return out


def newest_partial_step(found: Mapping[int, Stop]) -> int | None:
    """The latest step a rank stopped inside (its step record never came), or None."""
    return max((s.partial.step for s in found.values() if s.partial is not None), default=None)
