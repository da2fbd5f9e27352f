"""Collectives of one process group issued from two threads at once: their order differs between ranks.

torch.distributed numbers nothing: each rank's collectives on a group pair with its peers' in the order the
rank issues them. Two threads issuing on one group (a logging thread all-reducing a metric while the main
thread trains, a background checkpoint on the training group) reach torch in an order that depends on
scheduling, and so differs between the ranks: collectives pair with the wrong ones, which hangs, gives
wrong results, or aborts inside gloo ("Received data size doesn't match expected size"). The recorder
sees every collective's thread; when a group's collectives come from a thread, then another, then the first
again while the other still runs, that is such a race, and the rank says so once per group, with both
threads' names, before the pairing goes wrong (a ``collectives_from_threads`` warning).

Not a race: a hand-off (set-up on the main thread, training in a thread started afterwards, a final
barrier on the main thread once that thread has ended), nor torch's autograd threads, which run the DDP
engine's all-reduces on behalf of a main thread blocked in ``backward()``: they count as the main thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ddpscope.agent import emit_durable
from ddpscope.agent.log import get_logger
from ddpscope.agent.records import COLLECTIVES_FROM_THREADS

logger = get_logger(__name__)

MAIN = 0
"""The key of the main thread and of threads torch starts in C++ (autograd's) on its behalf."""
MAX_THREADS = 256
"""Threads remembered at most (idents are reused once a thread ends): beyond, the memory starts over."""


class IssuingThreads:
    """Which thread issued each group's collectives last, and which ones ever did.

    ``site``: where the current thread's call comes from (``file:line``), asked only to warn."""

    def __init__(self, site: Callable[[], str | None] = lambda: None) -> None:
        self._site = site
        self._last: dict[str, int] = {}
        self._seen: dict[str, set[int]] = {}
        self._keys: dict[int, int] = {}
        """thread ident -> its key (MAIN, or the ident of a thread started in Python)."""
        self._threads: dict[int, threading.Thread] = {}
        """key -> the thread, for the threads started in Python."""
        self._warned: set[str] = set()

    def note(self, pg: str, step: int | None) -> None:
        """The current thread issues a collective on ``pg``: two dict reads when it issued the last one."""
        key = self._keys.get(threading.get_ident())
        if key is None:
            key = self._learn()
        last = self._last.get(pg)
        if last == key:
            return
        self._last[pg] = key
        seen = self._seen.setdefault(pg, set())
        if last is not None and key in seen and pg not in self._warned and self._alive(last):
            self._warned.add(pg)
            self._warn(pg, key, last, step)
        seen.add(key)

    def _learn(self) -> int:
        thread = threading.current_thread()
        if len(self._keys) >= MAX_THREADS:
            self._keys.clear()
            self._threads.clear()
            self._seen.clear()
        if thread is threading.main_thread() or isinstance(thread, threading._DummyThread):
            key = MAIN
        else:
            key = thread.ident or 0
            self._threads[key] = thread
        self._keys[threading.get_ident()] = key
        return key

    def _alive(self, key: int) -> bool:
        thread = self._threads.get(key)
        return key == MAIN or (thread is not None and thread.is_alive())

    def _name(self, key: int) -> str:
        thread = self._threads.get(key)
        return "the main thread" if thread is None else f"thread {thread.name!r}"

    def _warn(self, pg: str, now: int, other: int, step: int | None) -> None:
        try:
            site = self._site()
        except Exception:
            site = None
        group = "the default process group" if pg == "default" else f"process group {pg}"
        at = f" (this call at {site})" if site else ""
        message = (
            f"Collectives on {group} are issued from two threads at once, {self._name(now)}{at} and "
            f"{self._name(other)}. Each rank's threads reach torch.distributed in their own order, which differs "
            "between the ranks, so collectives pair with the wrong ones: a hang, wrong results, or gloo's abort "
            '"Received data size doesn\'t match expected size". Issue every collective of a group from one '
            "thread, or give the other thread a process group of its own (dist.new_group, created on every rank "
            "in the same order)."
        )
        try:
            emit_durable(
                {
                    "kind": "warning",
                    "step": step,
                    "code": COLLECTIVES_FROM_THREADS,
                    "pg": pg,
                    "message": message,
                }
            )
        except Exception:
            logger.warning("ddpscope could not report collectives from two threads", exc_info=True)
        logger.warning("ddpscope: %s", message)
