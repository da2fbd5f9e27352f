"""Before the first step: a main thread blocked in torch's distributed machinery waits for its peers.

The hang watchdog does not report set-up (imports, model building, data loading, a checkpoint load: no
step to compare with, and routinely longer than a timeout tuned for steps). One kind of set-up is a wait
all the same: torch's ``DistributedDataParallel`` constructor checks the parameters' shapes across ranks
and broadcasts rank 0's state in C++, and returns only once every rank has constructed its model; a
collective torch issues in C++ (a plain torch DDP model's all-reduce in ``backward()``) is another. The
main thread's innermost Python frame says so (``agent/torch_waits.py``); its CPU share tells a wait from
torch's own work. ``where(frame)`` names the wait, ``message(...)`` is the hang report's sentence.

The watchdog follows one call: every sample of the ``timeout_s`` window must find the thread in the same
frame object of the same code, using under a tenth of the window on the CPU. Successive calls (one
``backward()`` per step) are not one wait: the thread is seen elsewhere in between (its forward, its
optimizer step), or busy. The frame is known by its id, never held: a frame kept past its call keeps its
locals alive (a process group just destroyed, with its sockets and threads, until the next sample).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from ddpscope.agent.torch_waits import (
    DDP_CONSTRUCTION_PLACE,
    DDP_CONSTRUCTION_WHAT,
    RENDEZVOUS_PLACE,
    TorchWait,
    blocked,
    torch_wait,
)
from ddpscope.ddp.hang_text import thread_words

DDP_FILE = "torch/nn/parallel/distributed.py"
MAX_OUTER_FRAMES = 8
"""How far out from the innermost frame the DDP constructor is looked for (it is 1-2 frames out)."""


@functools.lru_cache(maxsize=1024)
def _machinery(path: str) -> bool:
    """Whether a file is torch machinery that blocks on peers (cached: asked at every watchdog tick)."""
    return torch_wait(path, "") is not None


def _in_ddp_constructor(frame: FrameType) -> bool:
    outer: FrameType | None = frame
    for _ in range(MAX_OUTER_FRAMES):
        if outer is None:
            return False
        code = outer.f_code
        if code.co_name == "__init__" and code.co_filename.replace("\\", "/").endswith(DDP_FILE):
            return True
        outer = outer.f_back
    return False


def where(frame: FrameType) -> TorchWait | None:
    """The torch machinery a main thread whose innermost frame is ``frame`` is in, if any; inside torch's
    DistributedDataParallel constructor, that construction."""
    code = frame.f_code
    if not _machinery(code.co_filename):
        return None
    if _in_ddp_constructor(frame):
        return TorchWait(f"{DDP_CONSTRUCTION_PLACE} ({code.co_name})", DDP_CONSTRUCTION_WHAT)
    return torch_wait(code.co_filename, code.co_name)


def message(
    rank: str,
    waited_s: float,
    wait: TorchWait,
    *,
    main_site: str | None,
    main_cpu_s: float | None,
    last: dict[str, Any] | None,
    thread: str | None = None,
) -> str:
    """The sentence of a hang report for a rank that waits for its peers inside torch before any step;
    ``thread``: the name of the thread waiting when it is not the main thread (``training_thread.py``)."""
    if wait.place.startswith(DDP_CONSTRUCTION_PLACE):
        when = "before its first step"
    elif wait.place.startswith(RENDEZVOUS_PLACE):
        when = "before its process group exists"
    else:
        when = "with no step of a model ddpscope measures yet"
    parts = [f"rank {rank} has waited {waited_s:.1f} s for its peers inside {wait.place}, {when}"]
    if main_site:
        parts.append(f"{thread_words(thread)} waits at {main_site}")
    if main_cpu_s is not None:
        parts.append(f"it used {main_cpu_s:.1f} s of CPU meanwhile: blocked, waiting")
    if last:
        at = f" at {last['call_site']}" if last.get("call_site") else ""
        parts.append(f"its last recorded collective was {last['pg']}#{last['coll_seq']} {last['op']}{at}")
    what = wait.what[:1].upper() + wait.what[1:]
    return (
        "; ".join(parts)
        + f". {what}. This rank is not stuck itself: a peer that has not got there yet (still in its set-up,"
        " stuck or gone) holds it up; that peer's own heartbeats and reports say where it is."
    )


@dataclass(slots=True)
class Seen:
    """The main thread seen blocked in torch's machinery."""

    call: tuple[int, CodeType] | None
    """The innermost frame's id and code (``call_of``); None once the thread has left it."""
    wait: TorchWait
    since: float
    cpu_s: float | None
    """The main thread's CPU time at ``since``."""
    reported: bool = False
    left_at: float | None = None
    failures: tuple[int, ...] = ()
    """What counted failures when reported: any of them moving means the wait ended in a failure."""


def call_of(frame: FrameType | None) -> tuple[int, CodeType] | None:
    """What tells one call from another without holding its frame: the frame object's id (stable while
    the call runs) and its code. A later call can reuse the id; a sample in between tells them apart."""
    return None if frame is None else (id(frame), frame.f_code)


class Tracker:
    """Follows the main thread's innermost frame, sample by sample, while it is in torch's machinery."""

    def __init__(self, timeout_s: float, resolve_grace_s: float) -> None:
        self.timeout_s = timeout_s
        self.resolve_grace_s = resolve_grace_s
        self.seen: Seen | None = None

    @property
    def reported(self) -> Seen | None:
        """The wait reported and not yet over, if any."""
        return self.seen if self.seen is not None and self.seen.reported else None

    def forget(self) -> None:
        self.seen = None

    def sample(
        self, frame: FrameType, now: float, main_cpu_s: Callable[[], float | None]
    ) -> tuple[Seen, float, float | None] | None:
        """One look at the (unreported) main thread: (the wait, seconds waited, CPU used meanwhile) once
        it has waited ``timeout_s`` in one call, blocked; the wait is then marked reported."""
        seen = self.seen
        if seen is None or call_of(frame) != seen.call:
            wait = where(frame)
            self.seen = None if wait is None else Seen(call_of(frame), wait, now, main_cpu_s())
            return None
        waited_s = now - seen.since
        if waited_s < self.timeout_s:
            return None
        cpu_now = main_cpu_s()
        cpu_s = None if cpu_now is None or seen.cpu_s is None else max(0.0, cpu_now - seen.cpu_s)
        if blocked(cpu_s, waited_s) is False:
            seen.since, seen.cpu_s = now, cpu_now  # torch's own work (building buckets): judge anew
            return None
        seen.reported = True
        return seen, waited_s, cpu_s

    def over(self, frame: FrameType | None, now: float) -> Seen | None:
        """The reported wait, once the main thread has been out of that call for the grace period."""
        seen = self.reported
        if seen is None or (seen.call is not None and call_of(frame) == seen.call):
            return None
        if seen.left_at is None:
            seen.left_at, seen.call = now, None  # once left, a call never comes back
            return None
        if now - seen.left_at < self.resolve_grace_s:
            return None
        self.seen = None
        return seen
