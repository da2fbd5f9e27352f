"""SIGTERM for a rank whose main thread cannot run Python: blocked inside a collective.

Python runs signal handlers on the main thread, between bytecodes. A rank waiting in a gloo
collective stays in C until it completes or the process group times out (30 minutes by default),
so the agent's SIGTERM handler (``lifecycle``) never ran and, since it replaced the default action,
the rank ignored SIGTERM: without ddpscope it dies at once; with it, it lived on until the
launcher's SIGKILL (torchrun, Slurm: 30 s later) and its ``rank_exit`` was lost too.

Python's C-level handler still runs, on whichever thread the kernel picks, and writes the signal
number to the ``signal.set_wakeup_fd`` descriptor. This watcher, a daemon thread blocked on that
pipe (no CPU until a signal comes), gives the main thread ``GRACE_S`` to start the Python handler;
if it does not, the watcher does that handler's work itself (``flush``: ``rank_exit`` and the
bounded drain) and ends the process with the default action. ``signal.signal`` only works on the
main thread, so the default is restored through libc's ``signal()`` (ctypes) and the signal sent
again: the exit status is "killed by SIGTERM", as without ddpscope.

- Exactly one of the two runs the flush (``_claim``). If the main thread's handler starts while the
  watcher flushes, it waits for it (bounded) instead of flushing twice; a second SIGTERM that
  interrupts the main thread's own flush returns and lets that one finish.
- Only with a free wakeup fd: one set by someone else (asyncio's ``add_signal_handler``) is put back
  at once (with Python's default ``warn_on_full_buffer``: the old flag cannot be read) and SIGTERM
  works as before, handled when the main thread is back in Python. Code that sets its own wakeup fd
  later silently disables the watcher the same way.
- The watcher needs the GIL: a C call that blocks without releasing it stops every thread (gloo's
  waits release it).
- Only when SIGTERM's disposition before the agent was the default (``should_act``). A script's
  own Python handler cannot run while the main thread is blocked either, with or without ddpscope,
  and may choose to keep training: the watcher does not turn a SIGTERM the script handles into a
  kill. Records emitted so far are in the spool (every 0.1 s) or the write-ahead ring regardless.
- Fork: threads do not survive fork, so a child (a DataLoader worker) has no watcher; it gives up
  the inherited wakeup fd in ``after_in_child``, and around a fork from the main thread the parent
  unsets it, so a SIGTERM to the child can never be read as the parent's. (``subprocess`` children
  exec without running fork hooks; Python resets their handlers before exec on its vfork path, and
  the plain-fork path leaves a window of microseconds.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from ddpscope.agent._errors import swallowed
from ddpscope.agent.log import get_logger

logger = get_logger(__name__)

GRACE_S = 0.5
"""How long the main thread has to start its own SIGTERM handler before the watcher takes over. A
main thread running Python starts it within the GIL's switch interval (5 ms); waiting longer only
delays the exit of a rank that cannot."""
BACKSTOP_S = 1.0
"""After re-sending SIGTERM with the default action the process is gone; should it still run
(SIGTERM blocked in every thread), the watcher ends it with status 128 + SIGTERM after this."""


class Turn(Enum):
    """What the main thread's SIGTERM handler does (``main_turn``)."""

    FLUSH = "flush"
    """It won the claim: flush, then end the process."""
    WATCHER_FLUSHED = "watcher_flushed"
    """The watcher flushed (or its deadline passed): end the process, do not flush again."""
    NESTED = "nested"
    """A second SIGTERM interrupted the main thread's own handler: return and let it finish."""


_pipe: tuple[int, int] | None = None
"""(read, write) ends of the wakeup pipe while the watcher owns the wakeup fd in this process."""
_pid = 0
_handled = threading.Event()
"""Set by the main thread's handler when it starts: the watcher then stands down."""
_claim = threading.Lock()
_flushed = threading.Event()
_in_handler = False
_fork_hooks = False
_unset_for_fork = False
_fd_lost = False
"""Someone replaced our wakeup fd: the watcher hears nothing more, and fork hooks leave it alone."""


def start(flush: Callable[[], None], should_act: Callable[[], bool]) -> bool:
    """Take the wakeup fd and start the watcher; main thread only. True if it runs (or already ran).

    ``flush()`` emits ``rank_exit`` and drains the agent within its bound; ``should_act()`` says
    whether SIGTERM still means the agent's handler over the default action."""
    global _pipe, _pid, _fork_hooks
    if _pipe is not None and _pid == os.getpid():
        return True
    c_signal = _libc_signal()
    if c_signal is None:
        logger.info("ddpscope: no libc signal(); a rank blocked in C handles SIGTERM only once it returns")
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)  # required by set_wakeup_fd: the C handler must never block
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:
        # asyncio's signal handling (or another library's) reads its fd: give it back at once.
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        logger.info("ddpscope: the signal wakeup fd is in use (asyncio?); SIGTERM waits for the main thread")
        return False
    thread = threading.Thread(
        target=_watch, args=(r, flush, should_act, c_signal), name="ddpscope-sigterm", daemon=True
    )
    _pid = os.getpid()  # before the thread runs: it ignores signals read in any other process
    try:
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        signal.set_wakeup_fd(-1)
        os.close(r)
        os.close(w)
        return False
    _pipe = (r, w)
    if not _fork_hooks:
        _fork_hooks = True
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_fork_child
        )
    return True


def main_turn(wait_s: float) -> Turn:
    """Called first by the main thread's SIGTERM handler (default disposition): claim the flush, or
    wait up to ``wait_s`` for the watcher that already claimed it."""
    global _in_handler
    _handled.set()
    if _in_handler:
        return Turn.NESTED
    _in_handler = True  # before the claim: a nested call past the check above claims first instead
    if _claim.acquire(blocking=False):
        return Turn.FLUSH
    _flushed.wait(wait_s)
    return Turn.WATCHER_FLUSHED


def _watch(fd: int, flush: Callable[[], None], should_act: Callable[[], bool], c_signal: Any) -> None:
    try:
        while True:
            data = os.read(fd, 64)
            if signal.SIGTERM not in data:
                continue  # another signal with a Python handler (SIGINT, ...)
            if _handled.wait(GRACE_S) or os.getpid() != _pid or not should_act():
                continue
            if not _claim.acquire(blocking=False):
                continue  # the main thread's handler started just now and flushes
            try:
                flush()
            finally:
                _flushed.set()
            _die(c_signal)
    except Exception:  # the thread boundary: log, never raise into the process
        swallowed("sigterm watcher")


def _die(c_signal: Any) -> None:
    c_signal(signal.SIGTERM, int(signal.SIG_DFL))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(BACKSTOP_S)
    os._exit(128 + signal.SIGTERM)


def _libc_signal() -> Any:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).signal
        fn.argtypes = (ctypes.c_int, ctypes.c_void_p)
        fn.restype = ctypes.c_void_p
        return fn
    except (ImportError, OSError, AttributeError):
        return None


def _before_fork() -> None:
    global _unset_for_fork, _fd_lost
    if _pipe is None or _fd_lost or threading.current_thread() is not threading.main_thread():
        return
    old = signal.set_wakeup_fd(-1)
    if old == _pipe[1]:
        _unset_for_fork = True
    else:
        signal.set_wakeup_fd(old)
        _fd_lost = True


def _after_fork_parent() -> None:
    global _unset_for_fork
    if _unset_for_fork and _pipe is not None:
        _unset_for_fork = False
        signal.set_wakeup_fd(_pipe[1], warn_on_full_buffer=False)


def _fork_child() -> None:
    global _pipe, _handled, _claim, _flushed, _in_handler, _unset_for_fork
    # The parent's watcher may have held these at the fork; the child starts clean.
    _handled, _claim, _flushed, _in_handler = threading.Event(), threading.Lock(), threading.Event(), False
    pipe, _pipe = _pipe, None
    if pipe is None:
        return
    try:
        if not _unset_for_fork and not _fd_lost:  # forked from another thread: still set here
            old = signal.set_wakeup_fd(-1)
            if old != pipe[1]:
                signal.set_wakeup_fd(old)
        _unset_for_fork = False
        os.close(pipe[0])
        os.close(pipe[1])
    except (OSError, ValueError):
        swallowed("sigterm watcher after fork")
