"""Errors raised in training become ``rank_error`` records, shipped before the process exits.

Usage::

    from ddpscope.ddp.errors import install_error_hooks, capture_errors, report_error
    install_error_hooks()             # uncaught exceptions (main thread or any thread)
    with capture_errors():            # or @capture_errors() on the training function
        train()
    report_error(exc)                 # the engine, for errors it raises itself

A failing ``sys.exit`` (a non-zero status or a message: ``sys.exit("loss is NaN")``) reaches no
excepthook, and the process would look as if its loop had ended normally: the hooks also wrap
``sys.exit`` to note the call (status, step, phase, stack) and, at exit, report it as a fatal
``rank_error`` of type ``SystemExit`` unless training went on after it (the ``SystemExit`` was caught).
A bare ``raise SystemExit(3)`` is not seen; ``os._exit`` runs nothing at all (the collector then sees
a rank that stopped with no error, like a SIGKILL).

Fatal signals (gloo's SIGABRT on mismatched sizes) never reach Python; the agent's crash path
covers those. An exception is reported once per fatality: ``report_error(exc)`` followed by the same
exception escaping to ``sys.excepthook`` emits a second, ``fatal=True`` record, because the process
dying of it is new information; the same exception reported twice with the same flag is sent once.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any, NoReturn

from ddpscope.agent import emit, get_agent, lifecycle
from ddpscope.agent.log import get_logger
from ddpscope.ddp.collectives import RECORDER, disabled
from ddpscope.ddp.progress import PROGRESS

logger = get_logger(__name__)

FLUSH_TIMEOUT_S = 2.0
"""How long a dying process waits for its records to leave."""
MAX_STACK_CHARS = 20_000
_MARK = "__ddpscope_reported__"
_AGENT_MARK = "_ddpscope_reported"
_WHERE_MARK = "__ddpscope_where__"
_STORE_FILE_MARK = "__ddpscope_store_file__"
"""The ``store_file`` an exception was first reported with: said again when it ends the process."""
_fatal = [0]
"""Fatal errors reported and failing ``sys.exit`` calls noted so far in this process (``fatal_count``)."""


def fatal_count() -> int:
    """How many fatal errors this process has reported, failing ``sys.exit`` calls included (noted when
    called, reported at exit). The hang watchdog reads it: a wait that ended in one is not resolved."""
    return _fatal[0]


MAX_MESSAGE_CHARS = 4000


def _bounded(message: str) -> str:
    """``message`` within ``MAX_MESSAGE_CHARS``: its head and its tail. An exception torch re-raises from a
    DataLoader worker carries the worker's whole traceback, whose last line is what went wrong."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    half = MAX_MESSAGE_CHARS // 2 - 3
    return f"{message[:half]}\n…\n{message[-half:]}"


def report_error(
    exc: BaseException,
    fatal: bool = False,
    *,
    flush: bool | None = None,
    where: tuple[int | None, str, str] | None = None,
    thread: str | None = None,
    store_file: dict[str, Any] | None = None,
) -> bool:
    """Emit a ``rank_error`` for ``exc`` (step and phase from PROGRESS). Never raises.

    ``where``: (step, phase, stack) noted earlier, for an exception reported after the fact. ``thread``:
    the name of the thread the exception ended, when it is not the main thread. ``store_file``: a
    ``file://`` rendezvous's file that existed before ``init_process_group`` (``store_file.py``).

    Returns False when this exception was already reported with the same ``fatal`` flag. ``flush``
    (default: ``fatal``) waits up to 2 s for the record to leave the process.
    """
    try:
        # Bucket all-reduces that ended in a step whose record will not come now: said before the error.
        RECORDER.flush_folded()
        reported = getattr(exc, _MARK, ())
        if fatal in reported:
            return False
        # Where an exception was first reported is where it happened: reported again as it ends the
        # process, the rank has since left that phase (an engine error raised at the end of backward).
        step, phase = getattr(exc, _WHERE_MARK, (PROGRESS.step, PROGRESS.phase))
        if fatal:
            _fatal[0] += 1
        with contextlib.suppress(AttributeError, TypeError):  # some C exceptions refuse attributes
            setattr(exc, _MARK, (*reported, fatal))
            setattr(exc, _WHERE_MARK, (step, phase))
            if fatal:
                # The agent's own last-resort excepthook skips exceptions marked this way.
                setattr(exc, _AGENT_MARK, True)
        if where is None:
            stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        else:
            step, phase, stack = where
        # The step it failed in, as far as it got; only while the rank is still where it failed.
        partial = PROGRESS.step_so_far() if (step, phase) == (PROGRESS.step, PROGRESS.phase) else None
        if len(stack) > MAX_STACK_CHARS:
            # Keep the end: the innermost frames and the message are what a reader needs.
            stack = "...\n" + stack[-MAX_STACK_CHARS:]
        record = {
            "kind": "rank_error",
            "step": step,
            "phase": phase,
            "error_type": type(exc).__name__,
            "message": _bounded(lifecycle.exception_text(exc)) or type(exc).__name__,
            "stack": stack,
            "fatal": fatal,
            "partial_step": partial,
        }
        if thread is not None:
            record["thread"] = thread[:200]
        store_file = store_file or getattr(exc, _STORE_FILE_MARK, None)
        if store_file is not None:
            record["store_file"] = store_file
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, _STORE_FILE_MARK, store_file)
        emit(record)
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
        # A dying thread does not end the process (the main thread goes through sys.excepthook). Its
        # name: a main thread left waiting for what it would have made (a queue it filled) is told by it.
        thread = getattr(args, "thread", None)
        report_error(exc, fatal=False, flush=True, thread=getattr(thread, "name", None) or "?")
    previous = _previous.get("threading") or threading.__excepthook__
    previous(args)


_atexit_registered = False
_exit_call: list[Any] = []
"""The last failing ``sys.exit`` call: [status, step, phase, stack, progress counter]."""


def _sys_exit(status: object = None) -> NoReturn:
    """``sys.exit``, noting a failing status first (see the module docstring)."""
    if status is not None and status != 0:
        try:
            stack = "Traceback (most recent call last):\n" + "".join(traceback.format_stack()[:-1])
            stack += f"SystemExit: {status}\n"
            _exit_call[:] = [status, PROGRESS.step, PROGRESS.phase, stack, PROGRESS.counter]
            _fatal[0] += 1
        except Exception:
            logger.debug("ddpscope could not note sys.exit(%r)", status, exc_info=True)
    exit_ = _previous.get("exit")  # None once uninstalled: a caller kept this wrapper
    if exit_ is not None:
        exit_(status)
    raise SystemExit(status)  # what sys.exit does (after exit_ it is not reached: that raises)


def _report_failed_exit() -> None:
    """At exit (before the agent's own exit hook: atexit runs last-registered first): report the
    failing ``sys.exit`` that ended the process, if one did."""
    if not _exit_call or "sys" not in _previous:
        return
    status, step, phase, stack, counter = _exit_call
    if PROGRESS.counter != counter:
        return  # the SystemExit was caught and the process went on training
    code = status if isinstance(status, int) else 1
    said = f"sys.exit({status!r})" if isinstance(status, int) else f"{status} (sys.exit with this message)"
    error = SystemExit(f"{said}: exit status {code}")
    report_error(error, fatal=True, where=(step, phase, stack))
    lifecycle.set_exit_reason("error")


def install_error_hooks() -> None:
    """Wrap ``sys.excepthook``, ``threading.excepthook`` and ``sys.exit`` (idempotent; the previous
    hooks still run). Does nothing when ddpscope is disabled."""
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
        _previous["exit"] = sys.exit
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook
        sys.exit = _sys_exit
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_report_failed_exit)
            _atexit_registered = True


def uninstall_error_hooks() -> None:
    """Restore the hooks found by ``install_error_hooks`` (tests)."""
    with _hooks_lock:
        if "sys" not in _previous:
            return
        if sys.excepthook is _excepthook:
            sys.excepthook = _previous["sys"]
        if threading.excepthook is _threading_excepthook:
            threading.excepthook = _previous["threading"]
        if sys.exit is _sys_exit:
            sys.exit = _previous["exit"]
        _previous.clear()
        _exit_call.clear()


@contextlib.contextmanager
def error_hooks() -> Iterator[None]:
    """``install_error_hooks()`` for the duration of a block (tests, notebooks)."""
    install_error_hooks()
    try:
        yield
    finally:
        uninstall_error_hooks()
