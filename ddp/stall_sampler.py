"""When the watchdog samples a stall of the rank's own: the ``stall_sample`` records.

A rank that holds its peers up now and then (a checkpoint write, a slow batch) waits in no collective, so
nothing it records says where the time goes. The watchdog therefore sends its main thread's stack when
the rank has made no progress for a while with nothing of its in flight, after its first step
(``Watchdog._stalled_on_its_own``), and the collector's ``/stalls`` and incidents name the line.

How long "a while" is: ``STALL_SAMPLE_S``, or twice the rank's usual longest time without progress in a
step (the median over its last ``USUAL_STEPS`` steps) when that is longer, so a model whose every forward
takes a second is not sampled at every step, only when a step takes twice its usual. Then again at each
doubling of the stall (1, 2, 4 s ...) until a hang report takes over, and at most one stall in
``STALL_SAMPLE_EVERY_S``: a rank slow at every step (a straggler) sends a sample every few seconds.
"""

from __future__ import annotations

import statistics
from collections import deque

STALL_SAMPLE_S = 0.5
"""The shortest stall sampled: shorter ones (or shorter than the watchdog's tick) go unsampled."""
STALL_SAMPLE_EVERY_S = 5.0
"""At most one stall sampled in this long."""
USUAL_STEPS = 16
"""Steps whose longest time without progress make a rank's usual."""
MIN_USUAL_STEPS = 4


class StallSampler:
    """The watchdog's decision to sample; used from its thread only."""

    def __init__(self) -> None:
        self._longest: deque[float] = deque(maxlen=USUAL_STEPS)
        """Per recent step, the longest time without progress the watchdog saw in it."""
        self._step: int | None = None
        self._step_longest = 0.0
        self._next_s = STALL_SAMPLE_S
        """How long the current stall must last for its next sample."""
        self._first = True
        """The current stall has not been considered for a sample yet."""
        self._sampled_at = float("-inf")
        """When the last sampled stall's first sample was taken."""

    def progressed(self, step: int, quiet_s: float) -> None:
        """The rank made progress in ``step`` after ``quiet_s`` without: a new stall may begin."""
        if step != self._step:
            if self._step is not None:
                self._longest.append(self._step_longest)
            self._step, self._step_longest = step, 0.0
        self._step_longest = max(self._step_longest, quiet_s)
        self._next_s = self.threshold_s()
        self._first = True

    def threshold_s(self) -> float:
        """How long a stall must last for its first sample."""
        if len(self._longest) < MIN_USUAL_STEPS:
            return STALL_SAMPLE_S
        return max(STALL_SAMPLE_S, 2 * statistics.median(self._longest))

    def due(self, now: float, stalled_s: float) -> bool:
        """Whether to sample the current stall, ``stalled_s`` long, now (``now``: the watchdog's clock)."""
        if stalled_s < self._next_s:
            return False
        if self._first:
            self._first = False
            if now - self._sampled_at < STALL_SAMPLE_EVERY_S:
                self._next_s = float("inf")  # this stall goes unsampled
                return False
            self._sampled_at = now
        self._next_s = 2 * max(stalled_s, self._next_s)
        return True
