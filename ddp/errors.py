"""Errors raised in training become ``rank_error`` records, shipped before the process exits.

Usage::

    from ddpscope.ddp.errors import install_error_hooks, capture_errors, report_error
    install_error_hooks()             # uncaught exceptions (main thread or any thread)
    with capture_errors():            # or @capture_errors() on the training function
        train()
    report_error(exc)                 # the engine, for errors it raises itself

Fatal signals (gloo's SIGABRT on mismatched sizes) never reach Python; the agent's crash path
covers those. An exception is reported once per fatality: ``report_error(exc)`` followed by the same
exception escaping to ``sys.excepthook`` emits a second, ``fatal=True`` record, because the process
dying of it is new information; the same exception reported twice with the same flag is sent once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from ddpscope.agent import emit, get_agent
from ddpscope.ddp.collectives import disabled
from ddpscope.ddp.progress import PROGRESS

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 2.0
"""How long a dying process waits for its records to leave."""
MAX_STACK_CHARS = 20_000
_MARK = "__ddpscope_reported__"
_AGENT_MARK = "_ddpscope_reported"


def report_error(exc: BaseException, fatal: bool = False, *, flush: bool | None = None) -> bool:
    """Emit a ``rank_error`` for ``exc`` (step and phase from PROGRESS). Never raises.

    Returns False when this exception was already reported with the same ``fatal`` flag. ``flush``
    (default: ``fatal``) waits up to 2 s for the record to leave the process.
    """
    try:
        reported = getattr(exc, _MARK, ())
        if fatal in reported:
            return False
        with contextlib.suppress(AttributeError, TypeError):  # some C exceptions refuse attributes
            setattr(exc, _MARK, (*reported, fatal))
            if fatal:
                # The agent's own last-resort excepthook skips exceptions marked this way.
                setattr(exc, _AGENT_MARK, True)
        stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if len(stack) > MAX_STACK_CHARS:
            # Keep the end: the innermost frames and the message are what a reader needs.
            stack = "...\n" + stack[-MAX_STACK_CHARS:]
        emit(
            {
                "kind": "rank_error",
                "step": PROGRESS.step,
                "phase": PROGRESS.phase,
                "error_type": type(exc).__name__,
                "message": str(exc)[:4000] or type(exc).__name__,
                "stack": stack,
                "fatal": fatal,
            }
        )
        if fatal if flush is None else flush:
            get_agent().force_flush(FLUSH_TIMEOUT_S)
        return True
    except Exception:
        logger.warning("ddpscope could not report an error", exc_info=True)
        return False


class capture_errors(contextlib.ContextDecorator):
    """Report an exception escaping the block (or decorated function) as a ``rank_error``, flush, and
    let it propagate. ``fatal`` says whether escaping the block ends the process (the default)."""

    def __init__(self, fatal: bool = True) -> None:
        self.fatal = fatal

    def __enter__(self) -> capture_errors:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # An explicit exit and Ctrl-C are not training errors.
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            report_error(exc, fatal=self.fatal)


_previous: dict[str, Any] = {}
_hooks_lock = threading.Lock()


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    already = getattr(exc, _AGENT_MARK, False)  # reported as fatal by a hook that ran before this one
    if exc is not None and not already and not isinstance(exc, KeyboardInterrupt):
        if exc.__traceback__ is None:
            exc = exc.with_traceback(tb)
        report_error(exc, fatal=True)
    previous = _previous.get("sys") or sys.__excepthook__
    previous(exc_type, exc, tb)


def _threading_excepthook(args: Any) -> None:
    exc = args.exc_value
    if exc is not None and not isinstance(exc, SystemExit):
        # A dying thread does not end the process (the main thread goes through sys.excepthook).
        report_error(exc, fatal=False, flush=True)
    previous = _previous.get("threading") or threading.__excepthook__
    previous(args)


def install_error_hooks() -> None:
    """Wrap ``sys.excepthook`` and ``threading.excepthook`` (idempotent; the previous hooks still run).
    Does nothing when ddpscope is disabled."""
    if disabled():
        return
    try:
        # Create the agent first: it installs its own last-resort excepthook (no step or phase), which
        # must sit under this one so that this richer record is the one sent.
        get_agent()
    except Exception:
        logger.debug("no agent yet", exc_info=True)
    with _hooks_lock:
        if "sys" in _previous:
            return
        _previous["sys"] = sys.excepthook
        _previous["threading"] = threading.excepthook
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook


def uninstall_error_hooks() -> None:
    """Restore the hooks found by ``install_error_hooks`` (tests)."""
    with _hooks_lock:
        if "sys" not in _previous:
            return
        if sys.excepthook is _excepthook:
            sys.excepthook = _previous["sys"]
        if threading.excepthook is _threading_excepthook:
            threading.excepthook = _previous["threading"]
        _previous.clear()


@contextlib.contextmanager
def error_hooks() -> Iterator[None]:
    """``install_error_hooks()`` for the duration of a block (tests, notebooks)."""
    install_error_hooks()
    try:
        yield
    finally:
        uninstall_error_hooks()
