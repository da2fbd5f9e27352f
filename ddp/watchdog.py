"""Hang watchdog and heartbeat: one daemon thread per training process.

Usage (the engine starts it at construction; raw torch.distributed jobs may start it themselves)::

    from ddpscope.ddp.watchdog import start_watchdog
    start_watchdog()            # DDPSCOPE_HANG_TIMEOUT (300 s), DDPSCOPE_HEARTBEAT_S (2.0 s)

The thread samples ``PROGRESS.counter`` (moved by the engine and the collective recorder on every
event). When it has not moved for ``timeout_s`` while the rank is busy (phase other than 'idle', or a
collective in flight) it emits one ``hang`` record at once: phase, step, pending buckets, in-flight
collectives, every thread's stack and a sentence a person can act on. When the counter moves again it
emits ``hang_resolved``, unless what moved it was a collective ending in an error (``Progress.failures``,
a peer died): that hang ended in a failure, which the ``rank_error`` record reports, not in progress.
Every ``heartbeat_s`` it emits a ``heartbeat``, hung or not: a silent rank is itself a diagnosis at the
collector.

It keeps working while the main thread is blocked inside a gloo collective, because gloo releases the
GIL while it waits. It never raises: a failure in a tick is logged and counted, and the next tick runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpscope.agent import emit, get_agent
from ddpscope.ddp.collectives import RECORDER, CollectiveRecorder, disabled
from ddpscope.ddp.progress import PROGRESS, Progress
from ddpscope.ddp.stacks import thread_stacks

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
    "idle": "between steps",
    "forward": "forward",
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


def hang_message(
    rank: str,
    phase: str,
    step: int,
    stalled_s: float,
    pending: list[dict[str, Any]],
    inflight: list[dict[str, Any]],
    main_site: str | None = None,
    last: dict[str, Any] | None = None,
) -> str:
    """The sentence of a hang report: where this rank is stuck and what to look at next."""
    where = _PHASE_WORDS.get(phase, phase)
    if pending:
        first = pending[0]
        if first.get("launched"):
            where = f"all-reduce of bucket {first.get('index')}"
        else:
            where = f"backward, waiting for gradients of bucket {first.get('index')}"
    parts = [f"rank {rank} has made no progress for {stalled_s:.1f} s in {where} (step {step})"]
    if inflight:
        shown = [
            f"{c['pg']}#{c['coll_seq']} {c['op']}" + (f" at {c['call_site']}" if c.get("call_site") else "")
            for c in inflight[:3]
        ]
        more = f" (+{len(inflight) - 3} more)" if len(inflight) > 3 else ""
        verb = "is" if len(inflight) == 1 else "are"
        parts.append(f"collective {', '.join(shown)}{more} {verb} in flight")
    missing = [name for b in pending for name in b.get("missing", ())]
    if missing:
        extra = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        parts.append(f"parameters whose gradients never arrived: {', '.join(missing[:10])}{extra}")
    if last and not inflight:
        # Where this rank stands in the collective order: peers waiting in a later seq point here.
        at = f" at {last['call_site']}" if last.get("call_site") else ""
        parts.append(f"its last collective was {last['pg']}#{last['coll_seq']} {last['op']}{at}")
    if main_site:
        parts.append(f"the main thread waits at {main_site}")
    text = "; ".join(parts) + "."
    if inflight:
        first = inflight[0]
        text += (
            f" Look for a rank that has not issued {first['pg']}#{first['coll_seq']}: one that is stuck, "
            "dead, or issued a different collective at that sequence number."
        )
    elif missing:
        text += " Those parameters took no part in this step's forward on this rank."
    else:
        text += " No collective is in flight: this rank itself is stuck; see the main thread's stack."
    return text


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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_counter = progress.counter
        self._last_failures = progress.failures
        self._last_change = clock()
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
            emit(
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
                    emit({"kind": "hang_resolved", "step": progress.step, "hang_s": round(hang_s, 3)})
                    logger.warning("ddpscope: rank %s made progress again after %.1f s", _rank(), hang_s)
            self._last_counter = counter
            self._last_failures = failures
            self._last_change = now
            return
        stalled_s = now - self._last_change
        busy = progress.phase != "idle" or bool(progress.inflight)
        if not self._hung and busy and stalled_s >= self.timeout_s:
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
        phase, step = progress.phase, progress.step
        main_frame = sys._current_frames().get(threading.main_thread().ident or -1)
        main_site = self._recorder.frame_site(main_frame) if main_frame is not None else None
        recent = self._recorder.recent(1)
        message = hang_message(
            _rank(), phase, step, stalled_s, pending, inflight, main_site, recent[-1] if recent else None
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
