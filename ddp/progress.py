"""What this rank is doing right now: the state the hang watchdog and the heartbeat read.

Written on the training thread (engine hooks, the collective recorder), read from the watchdog thread.
Plain attribute writes are atomic under the GIL and cost tens of nanoseconds, so the hot path takes no
lock; readers tolerate a value that is one event stale.
"""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from typing import Any

PHASES = ("idle", "forward", "after_forward", "backward", "allreduce", "optimizer")
IN_STEP = frozenset({"forward", "after_forward", "backward", "allreduce"})
"""Phases of a step whose record is not sent yet (it is sent at the end of backward)."""
"""``after_forward``: the model's forward returned and backward has not begun (the loss, metrics: the
user's own code). No gradient is awaited yet, so a rank stuck there is stuck in its own code."""


class Progress:
    """One per process. ``counter`` moves on every event; the watchdog calls no-progress a hang.

    ``failures`` moves with ``counter`` when the event is a collective that ended in an error: the
    counter moved, but the rank did not make progress, and a hang that ends this way is not resolved.
    """

    __slots__ = (
        "phase",
        "step",
        "began",
        "counter",
        "failures",
        "last_coll_seq",
        "inflight",
        "pending_buckets",
        "settled",
        "partial_step",
        "trainer",
    )

    def __init__(self) -> None:
        self.phase = "idle"
        self.step = 0
        self.began = False
        """A step has begun: some phase other than 'idle' was entered. Until then an idle rank is in
        set-up (model building, the first batch), which the hang watchdog does not report."""
        self.counter = 0
        """Moves on every event; the watchdog samples it, so the hot path reads no clock."""
        self.failures = 0
        """Collectives that ended in an error (a peer died, a timeout): ends, not progress."""
        self.last_coll_seq = 0
        """Highest collective sequence number issued on the default group."""
        self.inflight: dict[tuple[str, int], Any] = {}
        """(pg, coll_seq) -> every collective issued and not yet completed: its record, or for a planned
        one the recorder's compact entry (read them through ``CollectiveRecorder.inflight()``)."""
        self.pending_buckets: Callable[[], list[dict[str, Any]]] = list
        """Set by the engine: returns the buckets still pending (wire shape PENDING_BUCKET)."""
        self.settled: Callable[[], set[tuple[str, int]]] = set
        """Set by the engine: (pg, coll_seq) of its asynchronous collectives that have completed but
        that it has not looked at yet (it ends them at its next hook or in its finalizer). A rank
        stuck in its own backward code is not inside those, whatever the recorder still holds."""
        self.partial_step: Callable[[], dict[str, Any] | None] = no_step
        """Set by the engine: the step in progress so far (``StepTimer.partial``), or None."""
        self.trainer: int | None = None
        """Ident of the thread that trains (``training_thread.py``): the one that made the process group or
        built the DDP model, then the one that began the latest step; the thread whose stack a report shows,
        which is not always the main thread."""

    def step_so_far(self) -> dict[str, Any] | None:
        """The unfinished step of a hang or error report: only inside a step (its record is not sent
        yet) and only the step this rank is in. Never raises: the report matters more."""
        if self.phase not in IN_STEP:
            return None
        try:
            partial = self.partial_step()
        except Exception:
            return None
        return partial if partial is not None and partial["step"] == self.step else None

    def enter(self, phase: str, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:  # a step's forward begins: note the thread that trains
            self.step = step
            self.trainer = get_ident()
        if phase != "idle":
            self.began = True
        self.tick()

    def tick(self) -> None:
        self.counter += 1

    def fail(self) -> None:
        """A collective ended in an error: an event (the wait is over), but no progress."""
        self.failures += 1
        self.counter += 1


def no_step() -> None:
    """``Progress.partial_step`` when no engine runs a step."""
    return None


PROGRESS = Progress()
"""The process-wide instance; the engine, the adapter, the recorder and the watchdog share it."""
