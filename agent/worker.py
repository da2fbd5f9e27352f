"""The one class that owns the agent's threading: a bounded deque drained by a background thread.

Producers append to ``queue`` directly (a deque append is atomic under the GIL and costs ~35 ns; no
lock, no syscall). The thread hands batches of at most ``max_batch`` items to ``export``:

- at once on ``wake()`` (urgent records);
- while records keep coming, every ``max(interval_s, BUSY_ROUND_S)``: each wake-up costs the
  training CPU, so a busy agent wakes ~10 times a second, not 50;
- after a round that found nothing it goes ``idle`` and sleeps up to ``IDLE_S``; the next producer,
  seeing ``idle``, calls ``nudge()``, and the worker drains ``interval_s`` later (the rest of the
  burst batched in). An idle agent wakes about once a second.

The worker and ``flush`` share one export lock, so a flush is synchronous: when it returns True
everything queued before the call has been exported, and tests never sleep. ``shutdown`` stops the thread, drains in
the caller and passes the remaining deadline on.

Fork: a forked child must not touch this object (its locks may have been held by a thread that does
not exist in the child); the agent replaces it after fork (see ``lifecycle``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpscope.agent._errors import swallowed
from ddpscope.agent.log import get_logger

logger = get_logger(__name__)

IDLE_S = 1.0
"""Longest sleep of an idle worker: it still ends rounds (stats) about once a second."""
BUSY_ROUND_S = 0.25
"""Shortest time between two rounds while records keep coming. A wake-up costs 50-150 us of CPU on
a small VM (measured: a bare ``time.sleep(0.02)`` loop, 47 us per wake-up; a round, ~150 us): at 50
rounds a second that alone was ~2 % of a training step; at 10 the agent thread took ~80 us of a
15 ms step, at 4 ~40 us (bench/cost_accounting.py). This is the SIGKILL loss window of records that
are only queued (a plain ``emit`` of an ordinary kind); the records ddpscope's engine, recorder and
watchdog emit are crash-durable before it (the agent copies them into the
write-ahead ring when they are emitted, ``ring.py``: step records as templates, ~25 us each with the
caches cold, where a stamped copy cost 50-100 us), and urgent ones wake the worker."""


class Worker:
    def __init__(
        self,
        *,
        export: Callable[[list[Any]], None],
        after_round: Callable[[bool], None],
        max_queue: int,
        max_batch: int,
        interval_s: float,
        on_start: Callable[[], None] | None = None,
        name: str = "ddpscope-agent",
    ) -> None:
        self.queue: collections.deque[Any] = collections.deque()
        """Producers append here after checking ``len(queue) < max_queue`` (a soft bound: concurrent
        producers may overshoot by one item each)."""
        self.max_queue = max_queue
        self._export = export
        self._after_round = after_round
        self._on_start = on_start
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._urgent = False
        self.idle = False
        """True while the thread sleeps for lack of records: the next producer must ``nudge()``."""
        self._thread: threading.Thread | None = None
        self._name = name

    def start(self) -> bool:
        """Start the thread; False if the interpreter refuses (at shutdown): flush() still works."""
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            # "can't create new thread at interpreter shutdown": degrade to synchronous flushes.
            self._thread = None
            logger.debug("ddpscope: agent thread not started (interpreter shutting down)")
            return False
        return True

    def wake(self) -> None:
        """Drain now (urgent records): no batching delay."""
        self._urgent = True
        self._event.set()

    def nudge(self) -> None:
        """A producer queued the first record after a quiet spell: end the idle sleep."""
        self.idle = False
        self._event.set()

    def _run(self) -> None:
        try:
            if self._on_start is not None:
                with self._lock:  # a concurrent flush() waits until the exporter exists
                    self._on_start()
        except Exception:
            swallowed("worker start")
        event, interval = self._event, self._interval_s
        busy_interval = max(interval, BUSY_ROUND_S)
        while not self._stopping:
            if self.idle:
                woken = event.wait(IDLE_S)
                event.clear()
                if woken and not self._urgent and not self._stopping:
                    # Nudged by the first record of a burst: batch the rest of it, as in a busy round.
                    event.wait(interval)
                    event.clear()
            else:
                event.wait(busy_interval)
                event.clear()
            if self._stopping:
                break
            self._urgent = False
            try:
                found = bool(self.queue)
                self._drain(deadline=None, final=False)
                if not found:
                    # Idle only after an empty round; set before the re-check so that a producer
                    # appending right now either is seen here or sees ``idle`` and nudges.
                    self.idle = True
                    if self.queue:
                        self.idle = False
                else:
                    self.idle = False
            except Exception:  # the one broad except: the thread must outlive any bug below it
                swallowed("worker")

    def _drain(self, deadline: float | None, final: bool) -> bool:
        timeout = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            q = self.queue
            while q:
                batch = []
                try:
                    for _ in range(self._max_batch):
                        batch.append(q.popleft())
                except IndexError:
                    pass  # drained: the deque has no atomic "pop up to n"
                self._export(batch)
                if deadline is not None and time.monotonic() > deadline:
                    return False
            self._after_round(final)
            return True
        finally:
            self._lock.release()

    def flush(self, timeout_s: float) -> bool:
        """Export everything queued so far, in the caller's thread; False if the deadline passed."""
        return self._drain(deadline=time.monotonic() + timeout_s, final=True)

    def locked(self, fn: Callable[[], object], timeout_s: float) -> bool:
        """Call ``fn`` under the export lock (as ``export`` is called); False if the lock stayed held by
        someone else for ``timeout_s``."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            fn()
            return True
        finally:
            self._lock.release()

    def persist(self, timeout_s: float) -> bool:
        """Like ``flush`` but an ordinary round (no end-of-round extras such as a stats record): the
        cheap synchronous write a caller does before something that may kill the process."""
        if not self.queue:
            return True  # the worker (or another caller) already exported everything
        return self._drain(deadline=time.monotonic() + timeout_s, final=False)

    def shutdown(self, timeout_s: float) -> bool:
        """Stop the thread and drain what is left, all within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._stopping = True
        self._event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
        return self._drain(deadline=deadline, final=True)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
