"""Process hooks of a live agent: fork, normal exit, SIGTERM, uncaught exceptions.

Installed once, when the first real (not disabled) agent is created; a disabled agent installs none.

- fork (``os.register_at_fork``): the child drops the parent's agent without touching its locks or
  thread (they may be mid-use in a thread the child does not have) and builds its own on first emit,
  with a new stream, so nothing is sent twice; faulthandler is switched off in the child, so a
  crashing DataLoader worker is not reported as its rank's crash.
- exit (``atexit``): a rank emits ``rank_exit`` ('finished', or 'error' after an uncaught exception),
  then the agent drains to the spool within 5 s. Forked children never emit ``rank_exit``. A
  delivery notice the shipper could not print on this process's stderr (``shipper.Notices``) is
  printed now (also on SIGTERM).
- SIGTERM: ``rank_exit`` ('sigterm', crash-durable at once) and the same 5 s drain, then the previous
  handler runs (or, if it was the default, the signal is re-raised so the exit status stays "killed
  by SIGTERM"). A rank blocked inside a C call (a collective) runs Python signal handlers only after
  it returns: over the default action, ``sigterm_watcher`` does the same from a thread after 0.5 s;
  over a script's own handler, SIGTERM waits for the main thread as it would without ddpscope.
  SIGTERM ignored (``SIG_IGN``) or handled in C (``getsignal`` is None) is left alone.
- ``sys.excepthook``: an uncaught exception becomes a fatal ``rank_error`` (unless the engine already
  reported it and set ``exc._ddpscope_reported = True``), then the previous hook runs.
- ``os._exit``: scripts end with it to skip a teardown that may hang, and atexit never runs there. A
  rank's call emits ``rank_exit`` first ('finished' for status 0, else 'error'), crash-durable at once,
  then the same bounded drain; without it a job that finished this way read as killed ("job_silent",
  failed). Forked children (DataLoader workers, multiprocessing) exit untouched.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NoReturn

from ddpscope.agent import sigterm_watcher
from ddpscope.agent._errors import swallowed

EXIT_FLUSH_S = 5.0
"""torchrun sends SIGKILL 30 s after SIGTERM; 5 s leaves the training code most of that."""

_installed = False
_exit_reason: str | None = None
_prev_sigterm: Any = signal.SIG_DFL
_prev_excepthook: Callable[..., Any] = sys.__excepthook__


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, which user code can make raise (an exception class whose ``__str__`` fails): then
    what the traceback module prints in its place, with the reason, so the error is still reported."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<exception str() failed: {type(inner).__name__}>"


def _no_agent() -> Any:
    return None


def set_exit_reason(reason: str) -> None:
    """What this process's ``rank_exit`` will say (``'error'``: the ddp layer saw it end in a failing
    ``sys.exit``, which reaches no excepthook)."""
    global _exit_reason
    _exit_reason = reason


_current: Callable[[], Any] = _no_agent


def install(current: Callable[[], Any], after_fork_child: Callable[[], None]) -> None:
    """``current()`` returns the live agent (or None); ``after_fork_child`` resets it in a child."""
    global _installed, _current, _prev_excepthook
    if _installed:
        return
    _installed = True
    _current = current
    atexit.register(_at_exit)
    os.register_at_fork(after_in_child=lambda: _fork_child(after_fork_child))
    _prev_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    os._exit = _os_exit
    install_sigterm()


def install_sigterm() -> bool:
    """Install the SIGTERM flush; only possible from the main thread (else retried at next configure)."""
    global _prev_sigterm
    if threading.current_thread() is not threading.main_thread():
        return False
    prev = signal.getsignal(signal.SIGTERM)
    if prev is None or prev == signal.SIG_IGN:
        # Ignored stays ignored (also in exec'd children); a C handler could not be chained to.
        return True
    if prev is not _on_sigterm:
        _prev_sigterm = prev
        signal.signal(signal.SIGTERM, _on_sigterm)
    if _watcher_may_act():
        sigterm_watcher.start(_sigterm_flush, _watcher_may_act)
    return True


def _watcher_may_act() -> bool:
    """SIGTERM still goes to our handler, over the default action (see ``sigterm_watcher``)."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm and _prev_sigterm == signal.SIG_DFL


def _is_rank(agent: Any) -> bool:
    return agent is not None and agent.live and not agent.forked and agent.config.rank is not None


def _fork_child(reset: Callable[[], None]) -> None:
    global _exit_reason
    _exit_reason = None
    if faulthandler.is_enabled():
        faulthandler.disable()
    reset()


def register_child_exit(agent: Any) -> None:
    """Flush a forked child's agent when it ends through multiprocessing (DataLoader workers).

    Such children leave with ``os._exit``: atexit never runs, but ``multiprocessing`` runs its
    finalizers first, so the child's last records still reach the spool.
    """
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util.Finalize(None, agent.shutdown, args=(EXIT_FLUSH_S,), exitpriority=100)


def _at_exit() -> None:
    try:
        agent = _current()
        if agent is None or not agent.live:
            return
        if _is_rank(agent):
            agent.emit({"kind": "rank_exit", "step": None, "reason": _exit_reason or "finished"})
        agent.shutdown(EXIT_FLUSH_S)
        _print_shipper_notice(agent)
    except Exception:
        swallowed("atexit")


def _print_shipper_notice(agent: Any) -> None:
    exporter = getattr(agent, "exporter", None)
    directory, prefix = getattr(exporter, "spool_dir", None), getattr(exporter, "prefix", None)
    if not isinstance(directory, str) or not isinstance(prefix, str):
        return  # not the spool exporter: no shipper
    from ddpscope.agent.shipper import take_notice

    line = take_notice(directory, prefix)
    if line:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr closed or None
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _exit_reason
    prev = _prev_sigterm
    if callable(prev):
        try:
            _exit_reason = "sigterm"
            agent = _current()
            if agent is not None and agent.live:
                # The user's handler decides whether to stop; rank_exit('sigterm') comes at exit.
                agent.force_flush(EXIT_FLUSH_S)
        except Exception:
            swallowed("sigterm")
        prev(signum, frame)
        return
    turn = sigterm_watcher.main_turn(EXIT_FLUSH_S + 1.0)
    if turn is sigterm_watcher.Turn.NESTED:
        return
    if turn is sigterm_watcher.Turn.FLUSH:
        _sigterm_flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _sigterm_flush() -> None:
    """``rank_exit`` ('sigterm') and the bounded drain, by the main thread's handler or by the watcher
    (whichever claimed it) before the process ends with SIGTERM's default action."""
    global _exit_reason
    try:
        _exit_reason = "sigterm"
        agent = _current()
        if agent is not None and agent.live:
            if _is_rank(agent):
                # Into the write-ahead ring at once: it survives even if the drain below times out.
                agent.emit_durable({"kind": "rank_exit", "step": None, "reason": "sigterm"})
            agent.shutdown(EXIT_FLUSH_S)
            _print_shipper_notice(agent)
    except Exception:
        swallowed("sigterm")


_real_os_exit = os._exit


def _os_exit(status: int) -> NoReturn:
    """``os._exit`` of a live rank: ``rank_exit`` into the write-ahead ring (the shipper delivers it after
    the process is gone), the agent drained to the spool within ``EXIT_FLUSH_S``, then the real exit."""
    try:
        agent = _current()
        if _is_rank(agent):
            reason = _exit_reason or ("finished" if status == 0 else "error")
            agent.emit_durable({"kind": "rank_exit", "step": None, "reason": reason})
            agent.shutdown(EXIT_FLUSH_S)
    except BaseException:  # exiting is what the caller asked for, whatever fails here
        pass
    _real_os_exit(status)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    global _exit_reason
    try:
        agent = _current()
        # A KeyboardInterrupt is a stop from outside (Ctrl-C, a forwarded SIGINT), like SIGTERM: not a
        # training error, and not a loop that ran out of batches either. Any other exception is an
        # error, also when the engine reported it: rank_exit must not say 'finished'.
        interrupted = issubclass(exc_type, KeyboardInterrupt)
        _exit_reason = (_exit_reason or "sigint") if interrupted else "error"
        if (
            agent is not None
            and agent.live
            and not issubclass(exc_type, KeyboardInterrupt)
            and not getattr(exc, "_ddpscope_reported", False)
        ):
            agent.emit(
                {
                    "kind": "rank_error",
                    "step": None,
                    "phase": "unknown",
                    "error_type": exc_type.__name__,
                    "message": exception_text(exc)[:2000],
                    "stack": "".join(traceback.format_exception(exc_type, exc, tb)),
                    "fatal": True,
                }
            )
    except Exception:
        swallowed("excepthook")
    _prev_excepthook(exc_type, exc, tb)
