"""Every thread's Python stack, formatted for a hang report (wire shape ``THREAD_STACK``).

Built from ``sys._current_frames()`` (``current_frames``), which works while the main thread is blocked
inside a collective: gloo releases the GIL while it waits, so the watchdog thread can read the frames.
"""

from __future__ import annotations

import gc
import sys
import threading
import traceback
from types import FrameType
from typing import Any

MAX_FRAMES = 60
"""Innermost frames kept per thread: deep recursion must not make a hang report megabytes long."""


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the garbage collector held off while it runs.

    CPython before 3.11.9 and 3.12.3 (gh-106883) builds that dict under the runtime's thread-list lock;
    a collection started by its allocation that frees a ``threading.local`` takes the same lock again
    and the calling thread stops for good, holding the GIL: the whole training process froze (seen in
    this project's tests on 3.11.7). Collections resume at once, as they were (a disabled collector
    stays disabled)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if was_enabled:
            gc.enable()


def format_stack(frame: FrameType) -> str:
    """``frame``'s stack as traceback prints it, innermost frame last, at most ``MAX_FRAMES`` of them."""
    lines = traceback.format_stack(frame, limit=None)
    if len(lines) > MAX_FRAMES:
        lines = [f"  ... {len(lines) - MAX_FRAMES} outer frames omitted\n", *lines[-MAX_FRAMES:]]
    return "".join(lines)


def thread_stacks(skip_current: bool = False) -> list[dict[str, Any]]:
    """One ``{"thread", "stack"}`` per live thread, the main thread first, innermost frame last."""
    threads = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    out = []
    for ident, frame in current_frames().items():
        if skip_current and ident == me:
            continue
        thread = threads.get(ident)
        name = thread.name if thread is not None else f"thread-{ident}"
        entry: dict[str, Any] = {"thread": name, "stack": format_stack(frame), "_main": ident == main}
        if thread is not None and ident != main:
            entry["daemon"] = thread.daemon  # a thread that is not one keeps the process from exiting
        out.append(entry)
    out.sort(key=lambda s: not s["_main"])
    for s in out:
        del s["_main"]
    return out
