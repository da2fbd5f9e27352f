"""Ranks stuck in their own code, read from their hang reports.

A hang report with no collective in flight and no bucket pending says the rank is not waiting for
anyone: its main thread is somewhere in user code (a data loader, a forward that never returns, a
sleep). Peers waiting in a collective are then waiting for *it*; the hang and collective diagnoses and
the timeout attribution all read this.

Such a report is a hang only while some peer waits in a collective (``waiters``). When every rank is
busy in its own code at once (an evaluation under ``torch.no_grad()`` on ``model.module``, a long
checkpoint every rank writes) no rank waits for another: the job is working, not hung, however long the
stretch. The watchdog cannot see progress in user code, so the collector decides.

A report with nothing in flight whose main thread is blocked inside torch's collective machinery
(``native_wait``: the C++ all-reduce of a DDP model ddpscope does not observe) is a wait, not the
rank's own code: it is a hang, and it makes the peer it waits for one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddpscope.agent.blocked_call import words as blocked_call_words
from ddpscope.agent.blocked_call import workers_words as blocked_call_workers_words
from ddpscope.agent.torch_waits import DATALOADER_FILE, QUEUE_WAIT_FILES
from ddpscope.server.analysis.incident_model import Record, first_line, phase_words, record_s, user_frame
from ddpscope.server.analysis.native_wait import FRAME, exiting, main_blocked, main_stack, native_wait
from ddpscope.server.analysis.snapshot import JobSnapshot

FROM_HANG_REPORT = " (its hang report)"
"""Ends what ``Stuck.phrase`` says: the rank's own hang report, which its hang incident tells already."""


@dataclass(frozen=True, slots=True)
class Stuck:
    """A rank that reported a hang with no collective in flight: stuck in its own code."""

    rank: int
    phase: str
    step: int | None
    site: str | None
    """file:line of the main thread's innermost user frame."""
    since_s: float
    blocked: bool | None = None
    """Its main thread waited through the stall (a lock, I/O, a sleep, a data loader's queue) rather than
    computed (a loop that does not end, a slow step); None when the report does not say."""
    loader: bool = False
    """Its main thread waited inside a DataLoader for a batch its worker processes did not deliver."""
    dead_thread: str = ""
    """``dead_thread_note``: a thread of the rank that died before it got stuck, when its main thread waits."""
    debugger: str | None = None
    """``debugger_wait``: the thread sits in a debugger waiting for a person (pdb's prompt, an attach)."""
    waits_on: str | None = None
    """``blocked_call.words`` of the report's ``blocked_call``: the system call a blocked thread sits in,
    and on what (a socket's peer, the process group's store, a path, a child process)."""
    workers: str | None = None
    """``workers_words`` of the report's ``loader_workers``: what its DataLoader's workers were doing."""

    def phrase(self) -> str:
        at = f" at {self.site}" if self.site else ""
        said = how_stuck(
            blocked=self.blocked,
            waits_on=self.waits_on,
            debugger=self.debugger,
            loader=self.loader,
            workers=self.workers,
        )
        how = f", {said}" if said else ""
        if self.phase == "idle":
            return f"stuck between steps after step {self.step}{at}{how}{self.dead_thread}{FROM_HANG_REPORT}"
        return f"stuck {phase_words(self.phase)} at step {self.step}{at}{how}{self.dead_thread}{FROM_HANG_REPORT}"


def how_stuck(
    *,
    blocked: bool | None,
    waits_on: str | None,
    debugger: str | None,
    loader: bool,
    workers: str | None = None,
) -> str:
    """How a rank stuck in its own code spent the stall, as a clause ("blocked, using no CPU, sleeping
    (clock_nanosleep)"): its culprit phrase (``Stuck.phrase``) and its own hang say it alike. '' when the
    report does not say. ``workers``: what its DataLoader's workers were doing (``workers_words``)."""
    if debugger:
        return debugger
    if loader:
        return f"{LOADER_WAIT}; {workers}" if workers else LOADER_WAIT
    if blocked is None:
        return ""
    if blocked and waits_on:
        return f"blocked, using no CPU, {waits_on}"
    if blocked:
        return "blocked, using no CPU (waiting on a lock, I/O, a queue or a sleep)"
    return "computing all along (a loop that does not end, or work far slower than usual)"


LOADER_WAIT = (
    "waiting inside its DataLoader for the next batch, which its worker processes did not deliver (a read "
    "that never returns, a deadlock or an endless loop in the dataset or its collate_fn; `py-spy dump --pid` "
    "on a worker shows where, and DataLoader(timeout=...) turns such a wait into an error)"
)

_LOADER_FRAME = re.compile("/" + re.escape(DATALOADER_FILE) + "$")
_WAIT_FRAME = re.compile("/(?:" + "|".join(map(re.escape, QUEUE_WAIT_FILES)) + ")$|<frozen")
"""Where a main thread waits for a DataLoader's worker: the loader's own code, then a queue's or lock's."""


def dead_thread_note(snapshot: JobSnapshot, rank: int, before_s: float) -> str:
    """ ", after its thread 'prefetcher' died (ValueError: ... at data.py:40): ..." when a thread of ``rank``
    other than its main thread died of an exception before ``before_s`` (the rank kept running): a main
    thread then blocked waits for what that thread would have made (a queue it filled, an event it set, a
    future it completed), which never comes. '' when none did."""
    dead = [
        e
        for e in snapshot.rank_errors
        if e["rank"] == rank and e.get("thread") and not e.get("fatal") and record_s(e) <= before_s
    ]
    if not dead:
        return ""
    e = dead[-1]
    site = user_frame(str(e.get("stack") or ""))
    at = f" at {site}" if site else ""
    return (
        f", after its thread {e['thread']!r} died ({e.get('error_type')}: {first_line(str(e.get('message', '')), 200)}"
        f"{at}): what the main thread waits for would have come from that thread (a queue it filled, an event "
        "it set), so it never comes"
    )


_PROMPT = (
    "stopped at a debugger's prompt ({name}), waiting for someone to type at its standard input: a "
    "breakpoint() or set_trace() left in the code, or reached on this rank only; continue it, or remove it "
    "(PYTHONBREAKPOINT=0 turns breakpoint() off)"
)
_PROMPT_LOOP = re.compile(r"^(?:interaction|_cmdloop|cmdloop)$")
_DEBUGGERS: tuple[tuple[re.Pattern[str], re.Pattern[str], str], ...] = (
    (re.compile(r"/pdb\.py$"), _PROMPT_LOOP, _PROMPT.format(name="pdb")),
    (re.compile(r"/(?:IPython/core/debugger|ipdb/__main__)\.py$"), _PROMPT_LOOP, _PROMPT.format(name="ipdb")),
    (re.compile(r"/pudb/debugger\.py$"), _PROMPT_LOOP, _PROMPT.format(name="pudb")),
    (
        re.compile(r"/debugpy/"),
        re.compile(r"^wait_for_client$"),
        "waiting for a debugger to attach (debugpy.wait_for_client()), which none has: attach one, or run "
        "without that call",
    ),
)
"""(file, function, words) of the frames where a thread waits for a person, not for its peers' work."""


def debugger_wait(stack: str) -> str | None:
    """What a thread whose stack is ``stack`` waits for when it sits in a debugger (pdb's prompt, ipdb's,
    pudb's, a debugpy attach), in words; None otherwise."""
    for path, _, function in FRAME.findall(stack):
        for file, func, words in _DEBUGGERS:
            if file.search(path) and func.search(function):
                return words
    return None


def waits_on(record: Record) -> str | None:
    """What a hang report's or stall sample's blocked training thread waits on, in words (its
    ``blocked_call``: ``agent/blocked_call.py``); None when the record does not say."""
    call = record.get("blocked_call")
    return blocked_call_words(call) if isinstance(call, Mapping) else None


def workers_words(record: Record) -> str | None:
    """What a hang report's or stall sample's ``loader_workers`` says its DataLoader's workers were doing
    ("its workers: worker 1151 ...", ``blocked_call.workers_words``); None when it does not say."""
    workers = record.get("loader_workers")
    said = blocked_call_workers_words(workers) if isinstance(workers, Sequence) else None
    return f"its workers: {said}" if said else None


def waits_for_loader(hang: Record) -> bool:
    """The hang report's main thread waits for a DataLoader's workers (``stack_waits_for_loader``)."""
    return stack_waits_for_loader(main_stack(hang) or "")


def stack_waits_for_loader(stack: str) -> bool:
    """The stack's innermost frames are a DataLoader waiting on its workers' queue: a frame of torch's
    dataloader.py with only queue, lock and pipe frames inside it (a dataset read in the main process,
    num_workers=0, puts the user's own frames innermost instead)."""
    frames = [path for path, _, _ in FRAME.findall(stack)]
    for i in range(len(frames) - 1, -1, -1):
        if _LOADER_FRAME.search(frames[i]):
            return all(_WAIT_FRAME.search(f) or _LOADER_FRAME.search(f) for f in frames[i + 1 :])
    return False


def main_site(hang: Record) -> str | None:
    """file:line where the hanging rank's main thread is, in user code."""
    return user_frame(main_stack(hang))


def hang_start_s(hang: Record) -> float:
    return record_s(hang) - float(hang.get("stalled_s", 0.0))


def in_own_code(hang: Record) -> bool:
    """The report shows the rank outside any collective, recorded or not, with no gradient awaited: in
    its own code."""
    return not hang.get("inflight") and not hang.get("pending_buckets") and native_wait(hang) is None


def span_s(snapshot: JobSnapshot, hang: Record) -> tuple[float, float]:
    """From the stall's start to the rank's first ``hang_resolved`` after the report (open-ended: a
    hang that ended in a death or an exit is treated as lasting, which only widens the overlap)."""
    resolved = [
        record_s(x)
        for x in snapshot.hang_resolved
        if x["rank"] == hang["rank"] and record_s(x) >= record_s(hang)
    ]
    return hang_start_s(hang), min(resolved, default=float("inf"))


Span = tuple[int, float, float]
"""(rank, start, end) of a stall (``span_s``)."""


def wait_spans(snapshot: JobSnapshot) -> list[Span]:
    """The stall of every report that shows a wait in a collective, recorded or not (or for gradients):
    what ``waiters`` compares a stall in a rank's own code with. A caller that asks about every report
    computes it once (each check of a report costs a look at its stack)."""
    return [(h["rank"], *span_s(snapshot, h)) for h in snapshot.hangs if not in_own_code(h)]


def waiters(snapshot: JobSnapshot, hang: Record, waits: Sequence[Span] | None = None) -> list[int]:
    """The other ranks that reported a wait in a collective, recorded or not (or for gradients), while
    this rank's stall lasted: the stall held them up. ``waits``: ``wait_spans(snapshot)``."""
    start, end = span_s(snapshot, hang)
    spans = wait_spans(snapshot) if waits is None else waits
    return sorted({r for r, s, e in spans if r != hang["rank"] and s < end and start < e})


def is_hang(snapshot: JobSnapshot, hang: Record, waits: Sequence[Span] | None = None) -> bool:
    """A wait in a collective (recorded or not) always is; a stall in the rank's own code only while a
    peer waits for it. ``waits``: ``wait_spans(snapshot)``."""
    if not in_own_code(hang) or exiting(hang):
        return True  # a rank that cannot exit is hung whether or not anyone waits for it
    return bool(waiters(snapshot, hang, waits))


def own_code_hangs(snapshot: JobSnapshot) -> list[Record]:
    """The hang reports of ranks in their own code (``in_own_code``), oldest first."""
    return [h for h in sorted(snapshot.hangs, key=record_s) if in_own_code(h)]


def stuck_outside(
    snapshot: JobSnapshot, at_s: float | None = None, own_code: Sequence[Record] | None = None
) -> dict[int, Stuck]:
    """Per rank, its first hang report in its own code (``in_own_code``): the rank is stuck in
    its own code (a data loader, a forward that never returns). Without ``at_s``, only hangs not since
    resolved; with it, hangs that covered that moment, resolved later or not (a rank asleep in forward
    for 25 s while its peers hit a 10 s timeout moves on afterwards, but it was the cause).
    ``own_code``: ``own_code_hangs(snapshot)``, for a caller that asks about many moments."""
    out: dict[int, Stuck] = {}
    for h in own_code_hangs(snapshot) if own_code is None else own_code:
        r = h["rank"]
        if r in out:
            continue
        start, resolved_s = span_s(snapshot, h)
        if at_s is None and resolved_s != float("inf"):
            continue
        if at_s is not None and not (start <= at_s <= resolved_s):
            continue
        blocked = main_blocked(h)
        dead = dead_thread_note(snapshot, r, start) if blocked is not False else ""
        out[r] = Stuck(
            r,
            str(h.get("phase")),
            h.get("step"),
            main_site(h),
            start,
            blocked,
            waits_for_loader(h),
            dead,
            debugger_wait(main_stack(h) or ""),
            waits_on(h) if blocked else None,
            workers_words(h),
        )
    return out
