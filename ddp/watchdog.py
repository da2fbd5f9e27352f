"""Hang watchdog and heartbeat: one daemon thread per training process.

Usage (the engine starts it at construction; raw torch.distributed jobs may start it themselves)::

    from ddpscope.ddp.watchdog import start_watchdog
    start_watchdog()            # DDPSCOPE_HANG_TIMEOUT (300 s), DDPSCOPE_HEARTBEAT_S (2.0 s)

The thread samples ``PROGRESS.counter``. Progress is what moves it: every phase change of a step
(forward, backward, all-reduce, back to idle), every gradient, and the start and end of every
collective, the engine's and the user's own (the recorder counts them). When it has not moved for
``timeout_s`` the thread emits one ``hang`` record at once: phase, step, pending buckets, in-flight
collectives, every thread's stack and a sentence a person can act on. When the counter moves again it
emits ``hang_resolved``, unless what moved it was a collective ending in an error (``Progress.failures``,
a peer died): that hang ended in a failure, which the ``rank_error`` record reports, not in progress.
Every ``heartbeat_s`` it emits a ``heartbeat``, hung or not: a silent rank is itself a diagnosis at the
collector.

From the first step on, the rule is the same in every phase, ``idle`` included. A rank stuck *between
steps* (a deadlocked data loader, a blocking queue, a checkpoint write that never returns) waits in no
collective, and its peers wait in the next step's all-reduce for it: its own report, phase ``idle``
with nothing in flight and no bucket pending, is the one that shows where it is stuck (the collector
reads such a report as "stuck in its own code" and blames that rank). Between steps, the next forward
and any collective are progress, so a long phase that issues collectives (an evaluation that
all-reduces its metrics, a sharded checkpoint) is never reported; one that goes on for ``timeout_s``
with neither is, since the timeout is the user's statement of how long no progress is acceptable. That
includes the time after the last step: stop the watchdog (``stop_watchdog()``) once training is done if
a long final save without collectives is expected. The report says how much CPU the main thread used
meanwhile: none means it is blocked, waiting; a lot means it is busy (long work, or a loop that never
ends).

Before the first step (``Progress.began`` still false: set-up, model building, loading a checkpoint,
starting data loader workers, the first batch) an idle rank is not reported; a collective in flight
still is, as in any phase. Set-up has no step to compare with: it routinely takes longer than a timeout
tuned for steps (tens of seconds of imports on a loaded machine, minutes to load a large checkpoint),
and reporting it would page at every start. A rank stuck there is still found: its peers report their
wait in the first step's all-reduce, and the collector names it from its heartbeats (phase idle, step
0). Jobs that never enter a phase (raw ``torch.distributed`` without the engine or ``instrument()``)
are, likewise, reported only inside collectives.

It keeps working while the main thread is blocked inside a gloo collective, because gloo releases the
GIL while it waits. It never raises: a failure in a tick is logged and counted, and the next tick runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpscope.agent import emit, emit_durable, get_agent
from ddpscope.agent.torch_waits import TorchWait, blocked, torch_wait
from ddpscope.ddp.collectives import RECORDER, CollectiveRecorder, disabled
from ddpscope.ddp.progress import PROGRESS, Progress
from ddpscope.ddp.stacks import current_frames, thread_stacks

logger = logging.getLogger(__name__)

ENV_HANG_TIMEOUT = "DDPSCOPE_HANG_TIMEOUT"
"""Seconds without progress before a hang report; default 300."""
ENV_HEARTBEAT = "DDPSCOPE_HEARTBEAT_S"
"""Seconds between heartbeats; default 2.0."""
DEFAULT_HANG_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_S = 2.0
MAX_TICK_S = 0.25
"""Longest sleep between samples: bounds the lateness of a report and of an async collective's end."""

_PHASE_WORDS = {
    "forward": "forward",
    "after_forward": "its own code between forward and backward (the loss, or other code after the model's forward)",
    "backward": "backward",
    "allreduce": "all-reduce",
    "optimizer": "the optimizer step",
}


def _setting(explicit: float | None, attrs: tuple[str, ...], env: str, default: float) -> float:
    """Explicit argument beats the agent's config beats the environment beats the default."""
    if explicit is not None:
        if explicit <= 0:
            raise ValueError(f"{attrs[0]} must be > 0, got {explicit!r}")
        return float(explicit)
    try:
        config = getattr(get_agent(), "config", None)
    except Exception:
        config = None
    for attr in attrs:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    raw = os.environ.get(env)
    if raw:
        try:
            value = float(raw)
            if value > 0:
                return value
        except ValueError:
            pass
        logger.warning("ignoring %s=%r (expected seconds > 0); using %s", env, raw, default)
    return default


def _rank() -> str:
    try:
        current = get_agent()
        rank = getattr(getattr(current, "config", None), "rank", None)
        if rank is None:
            rank = getattr(current, "rank", None)
        if rank is not None:
            return str(rank)
    except Exception:
        logger.debug("no agent to ask for the rank", exc_info=True)
    return os.environ.get("RANK", "?")


def _where(phase: str, step: int, began: bool, pending: list[dict[str, Any]], stuck_here: bool) -> str:
    """Where the rank is, as the end of "has made no progress for N s ..."."""
    if pending:
        first = pending[0]
        if first.get("launched"):
            return f"in all-reduce of bucket {first.get('index')} (step {step})"
        return f"in backward, waiting for gradients of bucket {first.get('index')} (step {step})"
    if phase != "idle":
        return f"in {_PHASE_WORDS.get(phase, phase)} (step {step})"
    if not began:  # only with a collective in flight: an idle rank in set-up is not reported
        return "before its first step"
    return f"between steps, after step {step}" + (
        " (the optimizer step, data loading or its own code)" if stuck_here else ""
    )


def _cpu_words(cpu_s: float, stalled_s: float) -> str:
    """Blocked or busy: the first question about a rank stuck in its own code."""
    used = f"the main thread used {cpu_s:.1f} s of CPU meanwhile"
    if blocked(cpu_s, stalled_s):
        return f"{used}: it is blocked, waiting (on a data loader, a queue, a lock, a file or a socket)"
    return (
        f"{used}: it is busy, not waiting (work longer than the timeout, or a loop that never ends; "
        f"if that work is expected, raise {ENV_HANG_TIMEOUT})"
    )


def hang_message(
    rank: str,
    phase: str,
    step: int,
    stalled_s: float,
    pending: list[dict[str, Any]],
    inflight: list[dict[str, Any]],
    main_site: str | None = None,
    last: dict[str, Any] | None = None,
    *,
    began: bool = True,
    main_cpu_s: float | None = None,
    blocked_in: TorchWait | None = None,
) -> str:
    """The sentence of a hang report: where this rank is stuck and what to look at next.

    ``began``: a step has begun (else an idle rank is still in set-up); ``main_cpu_s``: CPU seconds the
    main thread used during the stall, said when no collective is in flight (blocked or busy);
    ``blocked_in``: the torch machinery the main thread's innermost frame is in, if any
    (``agent/torch_waits.py``): blocked there, the rank waits for a peer in a collective not recorded.
    """
    missing = [name for b in pending for name in b.get("missing", ())]
    waits_unseen = (
        blocked_in is not None
        and not inflight
        and not pending
        and blocked(main_cpu_s, stalled_s) is not False
    )
    stuck_here = not inflight and not missing and not waits_unseen
    where = _where(phase, step, began, pending, stuck_here)
    parts = [f"rank {rank} has made no progress for {stalled_s:.1f} s {where}"]
    if inflight:
        shown = [
            f"{c['pg']}#{c['coll_seq']} {c['op']}" + (f" at {c['call_site']}" if c.get("call_site") else "")
            for c in inflight[:3]
        ]
        more = f" (+{len(inflight) - 3} more)" if len(inflight) > 3 else ""
        verb = "is" if len(inflight) == 1 else "are"
        parts.append(f"collective {', '.join(shown)}{more} {verb} in flight")
    if missing:
        extra = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        parts.append(f"parameters whose gradients never arrived: {', '.join(missing[:10])}{extra}")
    if last and not inflight:
        # Where this rank stands in the collective order: peers waiting in a later seq point here.
        at = f" at {last['call_site']}" if last.get("call_site") else ""
        parts.append(f"its last collective was {last['pg']}#{last['coll_seq']} {last['op']}{at}")
    if main_site:
        parts.append(f"the main thread waits at {main_site}")
    if main_cpu_s is not None and not inflight and not waits_unseen:
        parts.append(_cpu_words(main_cpu_s, stalled_s))
    text = "; ".join(parts) + "."
    if inflight:
        first = inflight[0]
        text += (
            f" Look for a rank that has not issued {first['pg']}#{first['coll_seq']}: one that is stuck, "
            "dead, or issued a different collective at that sequence number."
        )
    elif waits_unseen and blocked_in is not None:
        text += (
            f" No collective ddpscope records is in flight, but the main thread is blocked in {blocked_in.place}:"
            f" {blocked_in.what}. A peer that has not reached that collective holds this rank up (the collector"
            " names it from the peers' reports)."
        )
    elif missing:
        text += (
            " Either the backward pass is still computing or blocked before them (see the main thread's "
            "stack) or those parameters took no part in this step's forward on this rank."
        )
    else:
        text += (
            " No collective is in flight: this rank itself is stuck; see the main thread's stack."
            " Peers waiting in a collective are waiting for it."
        )
    return text


def _main_thread_cpu_s() -> float | None:
    """CPU seconds the main thread has used so far; None where the platform cannot tell."""
    try:
        ident = threading.main_thread().ident
        if ident is None:
            return None
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, OverflowError):  # no such clock here, or the thread is gone
        return None


_library_dirs: tuple[str, ...] | None = None
_verdicts: dict[str, bool] = {}
"""co_filename -> whether it is library code (read on the watchdog thread only, at report time)."""


def _is_library(filename: str) -> bool:
    """Whether a frame's file is not the user's: the standard library, installed packages, torch,
    ddpscope itself (the collector's ``user_frame`` draws the same line)."""
    global _library_dirs
    verdict = _verdicts.get(filename)
    if verdict is not None:
        return verdict
    if _library_dirs is None:
        paths = sysconfig.get_paths()
        dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
        # torch and ddpscope's own folders too: either may be an editable install outside them.
        for name in ("torch", "ddpscope.agent"):
            module_file = getattr(sys.modules.get(name), "__file__", None)
            if module_file:
                dirs.add(os.path.dirname(module_file))
        dirs.add(os.path.dirname(__file__))
        _library_dirs = tuple(os.path.join(os.path.abspath(d), "") for d in dirs)
    # "<frozen importlib._bootstrap>" and the like: the interpreter's own.
    verdict = filename.startswith("<frozen") or os.path.abspath(filename).startswith(_library_dirs)
    _verdicts[filename] = verdict
    return verdict


def _user_site(frame: Any) -> str | None:
    """``file:line`` of the innermost frame of user code in ``frame``'s stack (a blocked main thread
    is innermost in ``threading`` or ``queue``; the line to read is the user's call into them)."""
    cwd = os.path.join(os.getcwd(), "")
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return f"{filename.removeprefix(cwd)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _pending_wire(bucket: Any) -> dict[str, Any]:
    """Coerce one pending bucket to the wire shape: the agent drops a record that does not match,
    and a hang report must not be lost to a stray type from the engine's callback."""
    return {
        "index": int(bucket["index"]),
        "missing": [str(name) for name in bucket.get("missing", ())],
        "launched": bool(bucket.get("launched", False)),
    }


class Watchdog:
    """Samples a ``Progress`` on a daemon thread; reports hangs, their end, and heartbeats."""

    def __init__(
        self,
        *,
        timeout_s: float,
        heartbeat_s: float,
        progress: Progress = PROGRESS,
        recorder: CollectiveRecorder = RECORDER,
        clock: Callable[[], float] = time.monotonic,
        main_cpu_s: Callable[[], float | None] = _main_thread_cpu_s,
    ) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.tick_s = max(0.01, min(MAX_TICK_S, heartbeat_s, timeout_s / 4))
        self.errors = 0
        """Ticks that failed (logged; the thread goes on)."""
        self.hangs_reported = 0
        self._progress = progress
        self._recorder = recorder
        self._clock = clock
        self._main_cpu_s = main_cpu_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_counter = progress.counter
        self._last_failures = progress.failures
        self._last_change = clock()
        self._cpu_at_change = main_cpu_s()
        """The main thread's CPU time at ``_last_change``: blocked or busy, when a report says where."""
        self._hung = False
        self._next_heartbeat = 0.0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def hung(self) -> bool:
        return self._hung

    def start(self) -> Watchdog:
        if self.running:
            return self
        self._stop.clear()
        self._last_counter = self._progress.counter
        self._last_failures = self._progress.failures
        self._last_change = self._clock()
        self._cpu_at_change = self._main_cpu_s()
        self._next_heartbeat = self._last_change
        thread = threading.Thread(target=self._run, name="ddpscope-watchdog", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # interpreter shutting down: nothing left to watch
            logger.debug("ddpscope watchdog not started", exc_info=True)
            return self
        self._thread = thread
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread, then take one last sample: a hang that ended just before the
        process exits still gets its ``hang_resolved``."""
        was_running = self._thread is not None
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._thread = None
        if was_running and self._hung:
            try:
                self.check()
            except Exception:
                logger.debug("ddpscope watchdog final sample failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:
                # The thread boundary: one broad catch, logged, so the watchdog outlives its own bugs.
                self.errors += 1
                logger.warning("ddpscope watchdog tick failed", exc_info=True)
            self._stop.wait(self.tick_s)

    def check(self) -> None:
        """One sample: end completed async collectives, heartbeat if due, detect or resolve a hang."""
        now = self._clock()
        self._recorder.poll()
        progress = self._progress
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            # Durable (the ring, ~100 us every 2 s on this thread): a rank killed right after its last
            # heartbeat still shows when it was last alive, to the second.
            emit_durable(
                {
                    "kind": "heartbeat",
                    "phase": progress.phase,
                    "step": progress.step,
                    "last_coll_seq": progress.last_coll_seq,
                    "pid": os.getpid(),
                }
            )
        # Counter first: Progress.fail() moves failures before the counter, so a counter that shows
        # a failed end comes with its failure.
        counter = progress.counter
        failures = progress.failures
        if counter != self._last_counter:
            if self._hung:
                self._hung = False
                hang_s = now - self._last_change
                if failures != self._last_failures:
                    # The wait ended in an error (a peer died): over, but not resolved. The rank_error
                    # record tells that story; a hang_resolved would call it recovered.
                    logger.warning(
                        "ddpscope: rank %s's hang ended in a failed collective after %.1f s", _rank(), hang_s
                    )
                else:
                    emit_durable({"kind": "hang_resolved", "step": progress.step, "hang_s": round(hang_s, 3)})
                    logger.warning("ddpscope: rank %s made progress again after %.1f s", _rank(), hang_s)
            self._last_counter = counter
            self._last_failures = failures
            self._last_change = now
            self._cpu_at_change = self._main_cpu_s()
            return
        # Idle counts too once a step has begun: a rank stuck between steps (a data loader, a queue)
        # waits in no collective, and its report is the only place its stack shows up. Before the
        # first step only a collective in flight does (set-up has no step to compare with).
        stalled_s = now - self._last_change
        watched = progress.began or progress.phase != "idle" or bool(progress.inflight)
        if not self._hung and watched and stalled_s >= self.timeout_s:
            self._hung = True
            self.hangs_reported += 1
            self._report(stalled_s)

    def _report(self, stalled_s: float) -> None:
        progress = self._progress
        try:
            pending = [_pending_wire(b) for b in progress.pending_buckets()]
        except Exception:  # the engine's callback must not cost us the report
            logger.warning("ddpscope: pending_buckets() failed", exc_info=True)
            pending = []
        inflight = self._recorder.inflight()
        try:
            settled = progress.settled()
        except Exception:
            logger.warning("ddpscope: settled() failed", exc_info=True)
            settled = set()
        if settled:
            inflight = [c for c in inflight if (c["pg"], c["coll_seq"]) not in settled]
        phase, step = progress.phase, progress.step
        partial = progress.step_so_far()
        main_frame = current_frames().get(threading.main_thread().ident or -1)
        main_site = blocked_in = None
        if main_frame is not None:
            main_site = _user_site(main_frame) or self._recorder.frame_site(main_frame)
            blocked_in = torch_wait(main_frame.f_code.co_filename, main_frame.f_code.co_name)
        cpu_now, cpu_then = self._main_cpu_s(), self._cpu_at_change
        main_cpu_s = None if cpu_now is None or cpu_then is None else max(0.0, cpu_now - cpu_then)
        recent = self._recorder.recent(1)
        message = hang_message(
            _rank(),
            phase,
            step,
            stalled_s,
            pending,
            inflight,
            main_site,
            recent[-1] if recent else None,
            began=progress.began,
            main_cpu_s=main_cpu_s,
            blocked_in=blocked_in,
        )
        emit(
            {
                "kind": "hang",
                "phase": phase,
                "step": step,
                "stalled_s": round(stalled_s, 3),
                "pending_buckets": pending,
                "inflight": inflight,
                # The watchdog's own stack says nothing about the hang.
                "stacks": thread_stacks(skip_current=threading.current_thread() is self._thread),
                "message": message,
                "partial_step": partial,
                # Blocked (near 0) or busy: the collector tells a wait in torch's C++ from work by it.
                "main_cpu_s": None if main_cpu_s is None else round(main_cpu_s, 3),
            }
        )
        # The agent prints urgent records to stderr itself; this line is for the process's own log.
        logger.info("ddpscope: %s", message)


_watchdog: Watchdog | None = None
_lock = threading.Lock()
_atexit_registered = False


def start_watchdog(timeout_s: float | None = None, heartbeat_s: float | None = None) -> Watchdog:
    """Start this process's watchdog (idempotent) and return it.

    ``timeout_s`` / ``heartbeat_s`` default to the agent's config, then ``DDPSCOPE_HANG_TIMEOUT`` /
    ``DDPSCOPE_HEARTBEAT_S``, then 300 s / 2 s. Calling again with different values restarts it.
    With ``DDPSCOPE_DISABLED=1`` the returned watchdog is never started.
    """
    global _watchdog
    timeout = _setting(
        timeout_s, ("hang_timeout_s", "hang_timeout"), ENV_HANG_TIMEOUT, DEFAULT_HANG_TIMEOUT_S
    )
    heartbeat = _setting(
        heartbeat_s, ("heartbeat_s", "heartbeat_interval_s"), ENV_HEARTBEAT, DEFAULT_HEARTBEAT_S
    )
    with _lock:
        current = _watchdog
        if current is not None and current.running:
            if (current.timeout_s, current.heartbeat_s) == (timeout, heartbeat):
                return current
            current.stop()
        _watchdog = Watchdog(timeout_s=timeout, heartbeat_s=heartbeat)
        if not disabled():
            _watchdog.start()
            global _atexit_registered
            if not _atexit_registered:
                # Runs before the agent's own exit flush if the agent registered first (atexit is LIFO
                # and the agent is configured before the engine starts the watchdog).
                atexit.register(stop_watchdog, 1.0)
                _atexit_registered = True
        return _watchdog


def stop_watchdog(timeout_s: float = 5.0) -> None:
    """Stop and join this process's watchdog, if any (tests, clean shutdown)."""
    global _watchdog
    with _lock:
        current, _watchdog = _watchdog, None
    if current is not None:
        current.stop(timeout_s)


def get_watchdog() -> Watchdog | None:
    return _watchdog


def _forget_after_fork() -> None:
    # A forked child (a DataLoader worker) has no watchdog thread and must not report the parent's
    # progress as its own hang; it may start its own.
    global _watchdog, _lock
    _watchdog = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
