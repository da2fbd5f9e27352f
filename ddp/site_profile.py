"""Where the training thread spends its time, sampled: the ``site_profile`` records.

A straggler is slow in most steps by a little (40 ms more data preparation a batch), never stalled long
enough for a stall sample (``stall_sampler.py``), and its step records say only in which phase the time goes
("between steps"). Which line takes it is the question its user asks next. So at every tick the watchdog
notes the phase the rank is in and the innermost line of user code its training thread is at, and sends
the counts now and then: the collector's straggler analysis names the line a straggler's slow phase was
sampled at most (``server/analysis/straggler_sites.py``).

A statistical profile at the watchdog's tick (0.25 s): one frame walk a tick on the watchdog's thread, which
holds the GIL for a few microseconds. Its first record goes out ``FIRST_RECORD_S`` after sampling began, so
a short job has one; then at doubling intervals up to ``MAX_RECORD_EVERY_S``: records are small (at most
``MAX_SITES`` lines each) and a handful an hour.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

FIRST_RECORD_S = 5.0
MAX_RECORD_EVERY_S = 60.0
MAX_SITES = 12
"""Lines a record names, the most sampled; the rest are counted in ``other``."""
MIN_SAMPLES = 8
"""Fewer samples in a record's interval (a rank that was hung, or ended): no record."""


class SiteProfile:
    """Counts of (phase, site) since the last record; used from the watchdog's thread only."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str | None]] = Counter()
        self._since: float | None = None
        """When the samples counted now began (the watchdog's clock); None before the first."""
        self._every_s = FIRST_RECORD_S

    def add(self, now: float, phase: str, site: str | None) -> None:
        if self._since is None:
            self._since = now
        self._counts[(phase, site)] += 1

    def take(self, now: float, step: int, *, final: bool = False) -> dict[str, Any] | None:
        """The ``site_profile`` record of the samples so far when one is due, or whenever there are enough of
        them when ``final`` (the watchdog stops: a job shorter than the first interval has one too); it forgets
        them. Else None."""
        if self._since is None or (now - self._since < self._every_s and not final):
            return None
        counts, since = self._counts, self._since
        self._counts, self._since = Counter(), None
        self._every_s = min(MAX_RECORD_EVERY_S, 2 * self._every_s)
        total = sum(counts.values())
        if total < MIN_SAMPLES:
            return None
        top = counts.most_common(MAX_SITES)
        return {
            "kind": "site_profile",
            "step": step,
            "interval_s": round(now - since, 3),
            "samples": total,
            "sites": [{"phase": phase, "site": site, "n": n} for (phase, site), n in top],
            "other": total - sum(n for _, n in top),
        }
