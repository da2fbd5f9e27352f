"""Whether a collective is being called from inside a Python signal handler, and which signal's.

A preemption handler that checkpoints (``signal.signal(SIGTERM, save_and_exit)`` with a ``barrier`` or a
``state_dict`` gather inside) is a classic way to hang or corrupt a job: Python runs the handler in the
main thread between two bytecodes, wherever training happens to be, and a signal reaches ranks at
different moments or only some of them (one node preempted). The handler's collective then meets
whatever its peers are doing, a bucket all-reduce of the next step. The records alone read as a rank
that "left its training loop"; recorded with the signal, the collector names the handler.

Python leaves no mark on a handler's frame, so the frames of the stack are compared with the code of the
handlers installed for the signals a job commonly handles. ddpscope's own SIGTERM flush
(``agent.lifecycle``) stands for the script's handler it chains to, if any: it makes no collective itself.
Only a user's collective pays for this, never the engine's bucket all-reduces: with no handler of the
script's installed, 0.5 us (``_signal.getsignal``: ``signal.getsignal`` converts to enums at ~1 us a
call); with one, a walk of the stack by code identity, ~4 us for 30 frames (a code object's hash is not
cached). Such a call already costs ~65 us.
"""

from __future__ import annotations

import functools
import signal
import sys
from types import CodeType, FrameType
from typing import Any

from ddpscope.agent import lifecycle

try:
    from _signal import getsignal as _getsignal  # CPython's C function: no enum conversion
except ImportError:  # pragma: no cover - another interpreter
    _getsignal = signal.getsignal

_SIGNALS: tuple[tuple[int, str], ...] = tuple(
    (int(getattr(signal, name)), name)
    for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM", "SIGQUIT", "SIGXCPU")
    if hasattr(signal, name)
)
"""Signals a training script handles: preemption (TERM, USR1/USR2 as SLURM's --signal), Ctrl-C, a timer."""

_NUMBERS = tuple(number for number, _ in _SIGNALS)

_cache: tuple[tuple[Any, ...], dict[int, str]] = ((), {})
"""The handlers last seen, and the ``id`` of each one's code with its signal's name (the handlers in the
tuple keep their code alive, so an id is not reused while cached)."""


def _code_of(handler: Any) -> CodeType | None:
    """The code a Python handler runs: a function's, a bound method's, a partial's, a callable object's."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    handler = getattr(handler, "__func__", handler)
    code = getattr(handler, "__code__", None)
    if code is None:
        call = next((c.__dict__["__call__"] for c in type(handler).__mro__ if "__call__" in c.__dict__), None)
        code = getattr(call, "__code__", None)  # a callable object's method
    return code if isinstance(code, CodeType) else None


def _handler_codes() -> dict[int, str]:
    """The code id of each installed Python handler of the script's, with its signal's name; rebuilt when
    a handler changes."""
    global _cache
    handlers = tuple(map(_getsignal, _NUMBERS))
    known, codes = _cache
    if handlers == known:
        return codes
    codes = {}
    for (_, name), handler in zip(_SIGNALS, handlers, strict=True):
        if handler is lifecycle._on_sigterm:
            handler = lifecycle._prev_sigterm  # ddpscope's flush runs the script's handler, if any
        if callable(handler) and handler is not signal.default_int_handler:
            code = _code_of(handler)
            if code is not None:
                codes.setdefault(id(code), name)
    _cache = (handlers, codes)
    return codes


def handling_signal(frame: FrameType | None = None) -> str | None:
    """The name of the signal whose handler is on the stack above ``frame`` (default: the caller's), or
    None. Never raises."""
    try:
        codes = _handler_codes()
        if not codes:
            return None
        f: FrameType | None = frame if frame is not None else sys._getframe(1)
        while f is not None:
            name = codes.get(id(f.f_code))
            if name is not None:
                return name
            f = f.f_back
    except Exception:  # a signal module without getsignal, a frame torn down: say nothing
        return None
    return None
