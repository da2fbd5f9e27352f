"""Ranks blocked in a collective ddpscope does not record, read from the main thread's stack.

ddpscope records the collectives of the model it observes and the user's ``torch.distributed`` calls,
but not those torch issues in C++ for a model it does not observe: a second model left as plain
``DistributedDataParallel`` (a GAN's discriminator) all-reduces its gradients from torch's C++ Reducer
inside ``backward()``, and broadcasts its buffers and its construction state through
``dist._broadcast_coalesced``. A rank blocked there reports a hang with nothing in flight, as a rank
stuck in its own code does, and its peers could not tell the two apart: a stall in one rank's own
code that held its peer up in such an all-reduce made no incident at all.

The stack tells them apart: the main thread's innermost Python frame is in torch's autograd entry
point or its distributed machinery, and the thread was blocked (it used almost no CPU during the
stall). Busy there is computing (a long backward), not waiting, and stays the rank's own work.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from ddpscope.agent.exit_wait import at_exit
from ddpscope.agent.torch_waits import TorchWait, blocked, torch_wait

Record = Mapping[str, Any]

FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
"""One frame of a formatted stack: its path, line and function."""


def native_wait(hang: Record) -> TorchWait | None:
    """Where the reporting rank is blocked in a collective ddpscope does not record; None when its report
    shows a recorded wait, a bucket still pending, its own code, or a main thread busy on the CPU."""
    if hang.get("inflight") or hang.get("pending_buckets"):
        return None
    found = _machinery(main_stack(hang))
    if found is None:
        return None
    # Unknown CPU (a platform that cannot read the thread's clock): the stack alone decides.
    return None if main_blocked(hang) is False else found


def main_blocked(hang: Record) -> bool | None:
    """Whether the reporting rank's main thread was blocked (True) or busy (False) during its stall, from
    the CPU it used (``hang.main_cpu_s``); None when the report does not say."""
    return blocked(hang.get("main_cpu_s"), float(hang.get("stalled_s") or 0.0))


def training_thread(record: Record) -> str:
    """The name of the thread a hang report or stall sample is about: the one that trains (its
    ``thread`` field, sent when a loop runs on a thread of its own), else the main thread."""
    return str(record.get("thread") or "MainThread")


def thread_words(record: Record) -> str:
    """The words for the thread a record is about: "main thread", or "training thread 'trainer'" when the
    rank trains on another thread."""
    return named_thread_words(record.get("thread"))


def named_thread_words(thread: str | None) -> str:
    """``thread_words`` of a record whose ``thread`` field is ``thread``."""
    return "main thread" if not thread else f"training thread '{thread}'"


def main_stack(hang: Record) -> str | None:
    """The training thread's stack (the main thread's unless ``thread`` names another; else the first
    thread's). A plain loop: every own-code report is asked this about every other one
    (``stuck.waiters``), and a generator costs three times as much."""
    stacks = hang.get("stacks")
    if not stacks:
        return None
    trainer = training_thread(hang)
    for s in stacks:
        if s.get("thread") == trainer:
            return s.get("stack")
    return stacks[0].get("stack")


def _innermost(stack: str | None) -> tuple[str, str] | None:
    """(file, function) of a formatted stack's innermost frame (traceback order: the last one)."""
    frames = FRAME.findall(stack or "")
    if not frames:
        return None
    path, _, function = frames[-1]
    return path, function


@functools.lru_cache(maxsize=4096)
def _machinery(stack: str | None) -> TorchWait | None:
    """Cached by stack text: every hang report of a large job is asked about by every other one."""
    frame = _innermost(stack)
    return None if frame is None else torch_wait(*frame)


def joining_threads(hang: Record) -> bool:
    """Whether the report's main thread waits in Python's exit for threads that are not daemons
    (``agent/exit_wait.py``)."""
    frame = _innermost(main_stack(hang))
    return frame is not None and at_exit(frame[1], frame[0])


def exiting(hang: Record) -> bool:
    """Whether a hang report shows its rank stuck on its way out: its ``exiting`` flag (the script had ended),
    or, from agents that do not send it, a main thread seen joining threads at exit."""
    return bool(hang.get("exiting")) or joining_threads(hang)
