"""A rank that finished its script but cannot exit: Python waits at shutdown for its non-daemon threads.

The interpreter joins every thread not marked ``daemon`` before it exits (``threading._shutdown``), so one
that never ends (a metrics pusher, an upload loop, a ThreadPoolExecutor never shut down) keeps a rank alive
after training, holding its GPU or its node until the scheduler kills it. Its peers may have exited
cleanly: nobody waits for it, and a stall in a rank's own code nobody waits for is no hang. This one is: the
rank's work is over and it cannot leave. The main thread's innermost frame says so.

Standard library only: the hang watchdog writes the rank's sentence; the collector reads the report's
``exiting`` flag, or its main thread's innermost frame (``server/analysis/native_wait.exiting``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

ADVICE = (
    "Python joins every thread not marked daemon before the process exits: make such a thread a daemon "
    "(threading.Thread(..., daemon=True)), or stop and join it before the script ends (a metrics or upload "
    "loop, a ThreadPoolExecutor never shut down, a queue consumer waiting for a sentinel)"
)


HANDLER_ADVICE = (
    "Exit handlers (atexit) run after the script; one that blocks (an upload, a final save to storage that "
    "does not answer, a join on a thread) keeps the rank alive: give it a timeout, or do that work before the "
    "script ends"
)


def shutting_down() -> bool:
    """Whether this process's script has ended and Python is shutting down (joining threads, running
    atexit handlers): ``threading._shutdown`` sets the flag first thing (CPython 3.9+)."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False))


def at_exit(function: str, path: str) -> bool:
    """Whether a main thread whose innermost Python frame is ``function`` in ``path`` waits in Python's exit
    for non-daemon threads."""
    return function == "_shutdown" and path.replace("\\", "/").endswith("/threading.py")


def holders_phrase(threads: Sequence[tuple[str, str | None]]) -> str:
    """``thread 'pusher' (at push.py:12), thread 'x'`` for (name, where) pairs; 'a thread' when none."""
    if not threads:
        return "a non-daemon thread"
    named = [f"thread {name!r}" + (f" (at {where})" if where else "") for name, where in threads[:4]]
    more = f" and {len(threads) - 4} more" if len(threads) > 4 else ""
    return ", ".join(named) + more
