"""The thread that trains: the one whose stack and CPU a hang report or a stall sample is about.

Usually the main thread. Some launchers and frameworks run the training loop on a thread of their own
while the main thread only joins it; reading the main thread there sends its ``join()`` as the place a
rank is stuck. ``init_process_group`` and the DDP model's construction note their thread, and then each
step's forward (``Progress.trainer``, one plain write); the watchdog reads that thread while it lives, and
the main thread before any of them or once that thread has ended (exit runs there).
"""

from __future__ import annotations

import threading
import time
from types import FrameType

from ddpscope.ddp.progress import PROGRESS, Progress
from ddpscope.ddp.stacks import current_frames


def ident(progress: Progress = PROGRESS) -> int | None:
    """The training thread's ident: the thread of the latest forward while it lives, else the main one."""
    trainer = progress.trainer
    if trainer is not None and trainer in threading._active:  # type: ignore[attr-defined]
        return trainer
    return threading.main_thread().ident


def name(progress: Progress = PROGRESS) -> str | None:
    """The training thread's name when it is not the main thread (reports say which thread they mean);
    None for the main thread."""
    trainer = ident(progress)
    if trainer == threading.main_thread().ident:
        return None
    thread = threading._active.get(trainer)  # type: ignore[attr-defined]
    return thread.name if thread is not None else f"thread-{trainer}"


def native_id(progress: Progress = PROGRESS) -> int | None:
    """The training thread's id in the kernel (``/proc/self/task/<id>``), None when it is gone."""
    thread = threading._active.get(ident(progress))  # type: ignore[attr-defined]
    return None if thread is None else thread.native_id


def frame(progress: Progress = PROGRESS) -> FrameType | None:
    """The training thread's innermost frame, None when it has none to read."""
    trainer = ident(progress)
    return None if trainer is None else current_frames().get(trainer)


def cpu_s(progress: Progress = PROGRESS) -> float | None:
    """CPU seconds the training thread has used so far; None where the platform cannot tell."""
    try:
        trainer = ident(progress)
        if trainer is None:
            return None
        return time.clock_gettime(time.pthread_getcpuclockid(trainer))
    except (AttributeError, OSError, OverflowError):  # no such clock here, or the thread is gone
        return None
