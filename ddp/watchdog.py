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
starting data loader workers, the first batch) an idle rank is not reported. Set-up has no step to
compare with: it routinely takes longer than a timeout tuned for steps (tens of seconds of imports on a
loaded machine, minutes to load a large checkpoint), and reporting it would page at every start. A wait
for the peers is reported all the same: a collective in flight, as in any phase, and a main thread
blocked for ``timeout_s`` in one call into torch's distributed machinery (``setup_wait.py``): torch's
``DistributedDataParallel`` constructor, whose shape check and state broadcast run in C++ until every
rank has constructed its model, or another collective torch issues in C++ (a plain torch DDP model's
all-reduce inside ``backward()``), with the main thread using under a tenth of that time on the CPU.
That report says the rank waits for its peers there, not that it is stuck; its ``hang_resolved`` follows
once the thread has left that call, unless the process reported a fatal error meanwhile (a peer died).
A rank stuck in its own set-up (a missing file, a checkpoint load, a sleep) is still not reported: the
peers' waits and its heartbeats (phase idle, step 0) name it. ``import ddpscope.ddp`` before
``init_process_group`` starts the watchdog as that call begins (``monitor.py``), so this covers its
rendezvous (a peer that never started) and the DDP construction too. Jobs that never enter a phase (raw ``torch.distributed``, or torch DDP without
``instrument()``) are reported the same two ways. Heartbeats carry the group's ``world_size``.

It keeps working while the main thread is blocked inside a gloo collective, because gloo releases the
GIL while it waits. It never raises: a failure in a tick is logged and counted, and the next tick runs.
"""

from __future__ import annotations

import atexit
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from ddpscope.agent import emit, emit_durable, get_agent
from ddpscope.agent.blocked_call import read as read_blocked_call
from ddpscope.agent.blocked_call import read_process
from ddpscope.agent.clock import now_ns
from ddpscope.agent.config import (
    MIN_HANG_TIMEOUT_S,
    hang_timeout_from_env,
    heartbeat_from_env,
    memory_interval_from_env,
)
from ddpscope.agent.exit_wait import ADVICE, HANDLER_ADVICE, at_exit, holders_phrase, shutting_down
from ddpscope.agent.log import get_logger
from ddpscope.agent.memory import MemoryReader, worker_pids
from ddpscope.agent.torch_waits import blocked, torch_wait
from ddpscope.ddp import errors, setup_wait, training_thread
from ddpscope.ddp.collectives import FOLD_WAIT_NS, RECORDER, CollectiveRecorder, disabled
from ddpscope.ddp.hang_text import hang_message
from ddpscope.ddp.progress import PROGRESS, Progress
from ddpscope.ddp.site_profile import SiteProfile, waits_for_loader
from ddpscope.ddp.stacks import current_frames, format_stack, thread_stacks
from ddpscope.ddp.stall_sampler import StallSampler

logger = get_logger(__name__)

MAX_TICK_S = 0.25
"""Longest sleep between samples: bounds the lateness of a report and of an async collective's end."""
MAX_LOADER_WORKERS = 8
"""DataLoader workers a report describes, at most."""
RESOLVE_GRACE_S = 1.0
"""A reported wait in torch's machinery counts as over this long after the main thread left it, unless
the process reported a fatal error meanwhile: a wait that ends in an exception (a peer died) is not
resolved, and the error travels up to the excepthook in far less."""


def _setting(
    explicit: float | None,
    attrs: tuple[str, ...],
    from_env: Callable[[Mapping[str, str]], float],
    minimum: float = 0.0,
) -> float:
    """Explicit argument beats the agent's config beats the environment (read as the agent's config reads
    it, ``from_env``) beats the default. An explicit value under ``minimum`` is a ``ValueError``."""
    if explicit is not None:
        if explicit <= 0 or explicit < minimum:
            floor = f" and at least {minimum}" if minimum > 0 else ""
            raise ValueError(f"{attrs[0]} must be > 0{floor}, got {explicit!r}")
        return float(explicit)
    try:
        config = getattr(get_agent(), "config", None)
    except Exception:
        config = None
    for attr in attrs:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and value > 0:
            return max(float(value), minimum)
    return from_env(os.environ)


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


def _world_size() -> int | None:
    """The default process group's size, None while there is none (heartbeats carry it: the collector
    learns a job's size before any rank sends ``rank_start``)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # the group is being destroyed on the main thread
        logger.debug("ddpscope: no world size for the heartbeat", exc_info=True)
    return None


def _store_address() -> tuple[str, int] | None:
    """The default process group's TCPStore as (host, port): a blocked call on a connection to it is a
    wait for the store. None without one (no group yet, a file store)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        store: Any = dist.distributed_c10d._get_default_store()
        for _ in range(8):  # PrefixStores around the TCPStore
            if store is None:
                return None
            if hasattr(store, "port") and hasattr(store, "host"):
                return str(store.host), int(store.port)
            store = getattr(store, "underlying_store", None)
    except Exception:  # the group is being destroyed on the main thread
        logger.debug("ddpscope: no store address", exc_info=True)
    return None


def _main_frame() -> FrameType | None:
    """The main thread's innermost frame: where a script that has ended waits on its way out."""
    return current_frames().get(threading.main_thread().ident or -1)


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
    wire = {
        "index": int(bucket["index"]),
        "missing": [str(name) for name in bucket.get("missing", ())],
        "launched": bool(bucket.get("launched", False)),
    }
    if bucket.get("hook"):
        wire["hook"] = str(bucket["hook"])
    return wire


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
        main_cpu_s: Callable[[], float | None] | None = None,
        main_frame: Callable[[], FrameType | None] | None = None,
        world_size: Callable[[], int | None] = _world_size,
        memory: MemoryReader | None = None,
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
        # The training thread's (``training_thread.py``): the main thread unless the loop runs on another.
        self._main_cpu_s = main_cpu_s or (lambda: training_thread.cpu_s(progress))
        self._main_frame = main_frame or (lambda: training_thread.frame(progress))
        self._world_size = world_size
        self._memory = memory
        """Sends the rank's ``memory`` records beside its heartbeats (``start_watchdog`` gives one)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_counter = progress.counter
        self._last_failures = progress.failures
        self._last_change = clock()
        self._cpu_at_change = self._main_cpu_s()
        """The training thread's CPU time at ``_last_change``: blocked or busy, when a report says where."""
        self._hung = False
        self._next_heartbeat = 0.0
        self._last_beat = 0.0
        """When the last heartbeat was sent (``_clock``)."""
        self._beats = 0
        self._known_world_size: int | None = None
        """The group's size when last seen: a heartbeat sent after ``destroy_process_group`` still says it."""
        self._torch_waits = setup_wait.Tracker(timeout_s, min(RESOLVE_GRACE_S, timeout_s))
        """Before the first step: where the main thread waits in torch's machinery, if it does."""
        self._stalls = StallSampler()
        """When to sample a stall of the rank's own (``_sample_stall``)."""
        self._profile = SiteProfile()
        """The phase and line of user code the training thread is at, counted every tick (``site_profile.py``)."""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def hung(self) -> bool:
        return self._hung or self._torch_waits.reported is not None

    def start(self, first_heartbeat_s: float = 0.0) -> Watchdog:
        """Start the thread (idempotent); the first heartbeat goes out ``first_heartbeat_s`` from now."""
        if self.running:
            return self
        self._stop.clear()
        self._last_counter = self._progress.counter
        self._last_failures = self._progress.failures
        self._last_change = self._clock()
        self._cpu_at_change = self._main_cpu_s()
        self._next_heartbeat = self._last_change + max(0.0, first_heartbeat_s)
        self._known_world_size = self._world_size() or self._known_world_size
        thread = threading.Thread(target=self._run, name="ddpscope-watchdog", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # interpreter shutting down: nothing left to watch
            logger.debug("ddpscope watchdog not started", exc_info=True)
            return self
        self._thread = thread
        return self

    def heartbeat_within(self, seconds: float) -> None:
        """Send the next heartbeat within ``seconds`` (a watchdog started with a later first heartbeat)."""
        self._next_heartbeat = min(self._next_heartbeat, self._clock() + max(0.0, seconds))

    def expect_world_size(self, world_size: int | None) -> None:
        """The group's size before it exists (``init_process_group``'s argument, ``WORLD_SIZE``): heartbeats
        sent while the rendezvous waits say how many ranks the job should have."""
        if world_size is not None and world_size > 0 and self._known_world_size is None:
            self._known_world_size = world_size

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread, then take one last sample: a hang that ended just before the
        process exits still gets its ``hang_resolved``."""
        was_running = self._thread is not None
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._thread = None
        if not was_running:
            return
        try:
            if self._beats == 0:
                self._heartbeat()  # a process that ends before its first one still says its world size
            if self._hung:
                self.check()
            elif (profile := self._profile.take(self._clock(), self._progress.step, final=True)) is not None:
                emit(profile)
            seen = self._torch_waits.reported
            if seen is not None and (
                seen.call is None or setup_wait.call_of(self._main_frame()) != seen.call
            ):
                # Stopped at exit (or by the main thread): out of that wait, so it ended, one way or another.
                self._torch_waits.forget()
                self._end_torch_wait(seen, self._clock() if seen.left_at is None else seen.left_at)
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
        # Bucket ends folded into a step record that has not come within a second (a rank stuck after its
        # all-reduces): said on their own, or the collector would count them as waits.
        self._recorder.flush_folded(before_ns=now_ns() - FOLD_WAIT_NS)
        progress = self._progress
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            self._heartbeat()
        if self._torch_waits.seen is not None or not (progress.began or self._hung or progress.inflight):
            self._check_torch_wait(now)
        elif progress.began and not self._hung and not shutting_down():
            self._profile_tick(now)
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
            self._stalls.progressed(progress.step, now - self._last_change)
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
        elif self._stalled_on_its_own(stalled_s):
            self._sample_stall(stalled_s)

    def _profile_tick(self, now: float) -> None:
        """Count where the training thread is (a hung rank's time is its hang report's; at exit no step is
        held up); send the counts when a ``site_profile`` record is due."""
        frame = self._main_frame()
        if frame is None:
            return
        progress = self._progress
        self._profile.add(now, progress.phase, self._site(frame), waits_for_loader(frame))
        record = self._profile.take(now, progress.step)
        if record is not None:
            emit(record)

    def _stalled_on_its_own(self, stalled_s: float) -> bool:
        """Whether the rank's current stall is due a stack sample: after its first step, nothing of it in
        flight (a rank waiting for its peers is not the one holding them up), not on its way out (the
        script has ended: no step is held up), in a process group (not in a rendezvous that makes one again,
        nor after the group's end), and long enough (``StallSampler.due``)."""
        progress = self._progress
        return (
            not self._hung
            and progress.began
            and not progress.inflight
            and not shutting_down()
            and self._world_size() is not None
            and self._stalls.due(self._clock(), stalled_s)
        )

    def _sample_stall(self, stalled_s: float) -> None:
        """Send the main thread's stack in a stall of the rank's own (``stall_sampler.py``)."""
        frame = self._main_frame()
        if frame is None:
            return
        progress = self._progress
        main_cpu_s = self._main_cpu_since_change()
        waits_on = self._blocked_call(main_cpu_s, stalled_s)
        emit(
            {
                "kind": "stall_sample",
                "step": progress.step,
                "phase": progress.phase,
                "stalled_s": round(stalled_s, 3),
                "site": self._site(frame),
                "stack": format_stack(frame),
                "main_cpu_s": None if main_cpu_s is None else round(main_cpu_s, 3),
                **({"thread": thread} if (thread := training_thread.name(progress)) else {}),
                **({"blocked_call": waits_on} if waits_on else {}),
                **({"loader_workers": workers} if (workers := self._loader_workers(frame)) else {}),
            }
        )

    def _site(self, frame: FrameType | None) -> str | None:
        """file:line of ``frame``'s innermost user code, else of the call the recorder knows it by."""
        return None if frame is None else _user_site(frame) or self._recorder.frame_site(frame)

    def _loader_workers(self, frame: FrameType | None) -> list[dict[str, Any]] | None:
        """When the training thread waits in its DataLoader for the workers' next batch: each worker process
        with the system call it is blocked in (none: it runs), at most ``MAX_LOADER_WORKERS``; else None.
        Its Python stack is out of reach (another process); what the kernel says of it (a read of a path on
        a network mount, a lock) often is the answer."""
        if not waits_for_loader(frame):
            return None
        try:
            store = _store_address()
            workers = []
            for pid in sorted(worker_pids())[:MAX_LOADER_WORKERS]:
                call = read_process(pid, store)
                workers.append({"pid": pid, **({"blocked_call": call} if call else {})})
            return workers or None
        except Exception:  # never cost the report its other fields
            logger.debug("ddpscope: reading the DataLoader's workers failed", exc_info=True)
            return None

    def _blocked_call(self, main_cpu_s: float | None, stalled_s: float) -> dict[str, Any] | None:
        """The system call the training thread is blocked in (``agent/blocked_call.py``), when it used next
        to no CPU in the stall (a busy thread's is a moment's); None otherwise."""
        if blocked(main_cpu_s, stalled_s) is False:
            return None
        try:
            return read_blocked_call(training_thread.native_id(self._progress), _store_address())
        except Exception:  # never cost the report its other fields
            logger.debug("ddpscope: reading the blocked call failed", exc_info=True)
            return None

    def _main_cpu_since_change(self) -> float | None:
        """CPU seconds the main thread used since the last progress (near 0: blocked); None when unknown."""
        cpu_now, cpu_then = self._main_cpu_s(), self._cpu_at_change
        return None if cpu_now is None or cpu_then is None else max(0.0, cpu_now - cpu_then)

    def _heartbeat(self) -> None:
        progress = self._progress
        record: dict[str, Any] = {
            "kind": "heartbeat",
            "phase": progress.phase,
            "step": progress.step,
            "last_coll_seq": progress.last_coll_seq,
            "pid": os.getpid(),
        }
        world_size = self._known_world_size = self._world_size() or self._known_world_size
        if world_size is not None:
            record["world_size"] = world_size
        now = self._clock()
        if self._beats and now - self._last_beat > 2 * self.heartbeat_s:
            # This thread could not run (the GIL held, the process stopped): the collector keeps only a
            # rank's latest heartbeat, and this one, sent as the rank is freed, would hide the silence.
            record["silent_s"] = round(now - self._last_beat, 3)
        self._last_beat = now
        self._beats += 1
        # Durable (the ring, ~100 us every 2 s on this thread): a rank killed right after its last
        # heartbeat still shows when it was last alive, to the second.
        emit_durable(record)
        if self._memory is not None:
            sample = self._memory.due(now)
            if sample is not None:
                sample["step"] = progress.step
                emit_durable(sample)  # the last one before the OOM killer's SIGKILL is the evidence

    def _check_torch_wait(self, now: float) -> None:
        """Before the first step, with nothing recorded in flight: report a main thread blocked in one call
        into torch's distributed machinery for ``timeout_s`` (``setup_wait``), and the end of that wait."""
        tracker = self._torch_waits
        frame = self._main_frame()
        if tracker.reported is not None:
            over = tracker.over(frame, now)
            if over is not None and over.left_at is not None:
                self._end_torch_wait(over, over.left_at)
            return
        progress = self._progress
        if frame is None or progress.began or self._hung or progress.inflight:
            tracker.forget()  # from the first step on, or in a recorded collective: the usual rule
            return
        found = tracker.sample(frame, now, self._main_cpu_s)
        if found is None:
            return
        seen, waited_s, cpu_s = found
        seen.failures = (errors.fatal_count(), progress.failures)
        self.hangs_reported += 1
        recent = self._recorder.recent(1)
        thread = training_thread.name(progress)
        message = setup_wait.message(
            _rank(),
            waited_s,
            seen.wait,
            main_site=self._site(frame),
            main_cpu_s=cpu_s,
            last=recent[-1] if recent else None,
            thread=thread,
        )
        self._emit_hang(progress.phase, progress.step, waited_s, [], [], message, None, cpu_s, thread=thread)

    def _end_torch_wait(self, seen: setup_wait.Seen, left_at: float) -> None:
        hang_s = max(0.0, left_at - seen.since)
        if (errors.fatal_count(), self._progress.failures) != seen.failures:
            # It ended in an error (a peer died): the rank_error says so; hang_resolved would call it recovered.
            logger.warning("ddpscope: rank %s's wait in %s ended in a failure", _rank(), seen.wait.place)
            return
        emit_durable({"kind": "hang_resolved", "step": self._progress.step, "hang_s": round(hang_s, 3)})
        logger.warning("ddpscope: rank %s got out of %s after %.1f s", _rank(), seen.wait.place, hang_s)

    def _report(self, stalled_s: float) -> None:
        progress = self._progress
        self._recorder.flush_folded()  # what ended is said before the report of what did not
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
        main_frame = self._main_frame()
        main_site = self._site(main_frame)
        blocked_in = None
        if main_frame is not None:
            blocked_in = torch_wait(main_frame.f_code.co_filename, main_frame.f_code.co_name)
        main_cpu_s = self._main_cpu_since_change()
        if shutting_down():
            # The script has ended: the main thread runs Python's exit, whichever thread trained.
            exit_frame = _main_frame()
            message = _exit_wait(stalled_s, exit_frame, self._site(exit_frame))
            self._emit_hang(
                phase, step, stalled_s, pending, inflight, message, partial, main_cpu_s, exiting=True
            )
            return
        recent = self._recorder.recent(1)
        thread = training_thread.name(progress)
        # Only outside a collective: inside one the thread waits for gloo (a futex), which says nothing new.
        waits_on = None if inflight else self._blocked_call(main_cpu_s, stalled_s)
        workers = None if inflight else self._loader_workers(main_frame)
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
            thread=thread,
            blocked_call=waits_on,
            loader_workers=workers or (),
        )
        self._emit_hang(
            phase,
            step,
            stalled_s,
            pending,
            inflight,
            message,
            partial,
            main_cpu_s,
            thread=thread,
            blocked_call=waits_on,
            loader_workers=workers,
        )

    def _emit_hang(
        self,
        phase: str,
        step: int,
        stalled_s: float,
        pending: list[dict[str, Any]],
        inflight: list[dict[str, Any]],
        message: str,
        partial: dict[str, Any] | None,
        main_cpu_s: float | None,
        *,
        exiting: bool = False,
        thread: str | None = None,
        blocked_call: dict[str, Any] | None = None,
        loader_workers: list[dict[str, Any]] | None = None,
    ) -> None:
        """``thread``: the training thread's name when the report is about it and it is not the main one;
        ``blocked_call``: the system call it is blocked in; ``loader_workers``: its DataLoader's workers, when
        it waits for them."""
        extra: dict[str, Any] = {"exiting": True} if exiting else {}
        if thread is not None:
            extra["thread"] = thread  # the stack (and CPU) the report is about is not the main thread's
        if blocked_call:
            extra["blocked_call"] = blocked_call
        if loader_workers:
            extra["loader_workers"] = loader_workers
        emit(
            {
                **extra,
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


def _exit_wait(stalled_s: float, main_frame: FrameType | None, main_site: str | None) -> str:
    """The report of a rank whose script has ended and whose main thread is stuck on the way out: waiting
    in Python's exit for threads that are not daemons, or in an exit handler."""
    head = f"rank {_rank()} finished its script {stalled_s:.1f} s ago but cannot exit"
    if main_frame is None or not at_exit(main_frame.f_code.co_name, main_frame.f_code.co_filename):
        where = f" at {main_site}" if main_site else ""
        return f"{head}: its main thread runs an exit handler that has not returned{where}. {HANDLER_ADVICE}."
    frames = current_frames()
    holders = [
        (t.name, _user_site(frames[t.ident]) if t.ident in frames else None)
        for t in threading.enumerate()
        if not t.daemon and t is not threading.main_thread() and t.is_alive()
    ]
    have = "has" if len(holders) < 2 else "have"
    return (
        f"{head}: its main thread waits in Python's shutdown for {holders_phrase(holders)}, which {have} not "
        f"ended. {ADVICE}."
    )


_watchdog: Watchdog | None = None
_lock = threading.Lock()
_atexit_registered = False


def heartbeat_setting(heartbeat_s: float | None = None) -> float:
    """Seconds between heartbeats: ``heartbeat_s``, else the agent's config, ``DDPSCOPE_HEARTBEAT_S``, 2 s."""
    return _setting(heartbeat_s, ("heartbeat_s", "heartbeat_interval_s"), heartbeat_from_env)


def hang_timeout_setting(timeout_s: float | None = None) -> float:
    """Seconds without progress before a hang report: ``timeout_s``, else the agent's config,
    ``DDPSCOPE_HANG_TIMEOUT``, 300 s. What ``start_watchdog`` uses and ``rank_start`` reports."""
    return _setting(timeout_s, ("hang_timeout_s", "hang_timeout"), hang_timeout_from_env, MIN_HANG_TIMEOUT_S)


def start_watchdog(
    timeout_s: float | None = None, heartbeat_s: float | None = None, first_heartbeat_s: float = 0.0
) -> Watchdog:
    """Start this process's watchdog (idempotent) and return it.

    ``timeout_s`` / ``heartbeat_s`` default to the agent's config, then ``DDPSCOPE_HANG_TIMEOUT`` /
    ``DDPSCOPE_HEARTBEAT_S``, then 300 s / 2 s. Calling again with different values restarts it.
    A watchdog started here sends its first heartbeat ``first_heartbeat_s`` from now (and, if it is
    stopped before that, one as it stops). With ``DDPSCOPE_DISABLED=1`` it is never started.
    """
    global _watchdog
    timeout = hang_timeout_setting(timeout_s)
    heartbeat = heartbeat_setting(heartbeat_s)
    with _lock:
        current = _watchdog
        if current is not None and current.running:
            if (current.timeout_s, current.heartbeat_s) == (timeout, heartbeat):
                return current
            current.stop()
        _watchdog = Watchdog(
            timeout_s=timeout,
            heartbeat_s=heartbeat,
            memory=MemoryReader(memory_interval_from_env(os.environ)),
        )
        if not disabled():
            _watchdog.start(first_heartbeat_s)
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
