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

Shorter stalls that recur are sampled too: a 0.3 s checkpoint write every fifth step, waited out by every
other rank, can cost a job most of its time without one stall reaching ``STALL_SAMPLE_S``. The watchdog
sees progress only at its ticks (0.25 s apart), so a rank that progresses all the time goes quiet for one
tick at a time as it sees it (its usual: a little over a tick, the watchdog waits for the GIL), and a stall
shows as a step that went quiet for two ticks or more. Once ``RECURRING_STALLS`` steps within
``RECURRING_WINDOW_STEPS`` went quiet for ``RECURRING_FACTOR`` times the usual (and at least
``MIN_RECURRING_S``), a stall is sampled at ``RECURRING_SHARE`` of the usual: at the first tick that finds no
progress since the last. A stall shorter than two ticks is seen only when a whole tick falls inside
it, so of 0.3 s stalls one in five is; the samples still come every ``STALL_SAMPLE_EVERY_S`` in a long job.
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
RECURRING_STALLS = 3
"""Stalls of a step each, too short for ``STALL_SAMPLE_S``, that make a pattern worth sampling earlier."""
RECURRING_WINDOW_STEPS = 100
"""...within this many steps."""
RECURRING_FACTOR = 1.5
"""A step whose longest time without progress is this many times the usual held a stall of its own: two
ticks against one (not 2: the usual is a tick and a little more, a stall of one tick's two ticks exactly)."""
RECURRING_SHARE = 0.9
"""Once stalls recur, one is sampled when it has lasted this share of the usual: one tick (a tick without
progress lasts at least a tick, the usual a tick and a little more)."""
MIN_RECURRING_S = 0.1
"""Shorter stalls are not worth a stack, however often they come (the watchdog ticks every 0.25 s anyway)."""


class StallSampler:
    """The watchdog's decision to sample; used from its thread only."""

    def __init__(self) -> None:
        self._longest: deque[float] = deque(maxlen=USUAL_STEPS)
        """Per recent step, the longest time without progress the watchdog saw in it."""
        self._recurring: deque[int] = deque(maxlen=RECURRING_STALLS)
        """The latest steps that held a stall of their own."""
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
                self._step_done(self._step, self._step_longest)
            self._step, self._step_longest = step, 0.0
        self._step_longest = max(self._step_longest, quiet_s)
        self._next_s = self.threshold_s()
        self._first = True

    def _usual_s(self) -> float | None:
        """The rank's usual longest time without progress in a step; None before ``MIN_USUAL_STEPS``."""
        return statistics.median(self._longest) if len(self._longest) >= MIN_USUAL_STEPS else None

    def _step_done(self, step: int, longest_s: float) -> None:
        usual = self._usual_s()
        if usual is not None and longest_s >= max(MIN_RECURRING_S, RECURRING_FACTOR * usual):
            self._recurring.append(step)
        self._longest.append(longest_s)

    def threshold_s(self) -> float:
        """How long a stall must last for its first sample."""
        usual = self._usual_s()
        if usual is None:
            return STALL_SAMPLE_S
        threshold = max(STALL_SAMPLE_S, 2 * usual)
        recurring = self._recurring
        if (
            len(recurring) == RECURRING_STALLS
            and self._step is not None
            and self._step - recurring[0] <= RECURRING_WINDOW_STEPS
        ):
            threshold = min(threshold, max(MIN_RECURRING_S, RECURRING_SHARE * usual))
        return threshold

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
