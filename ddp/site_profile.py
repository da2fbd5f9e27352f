"""Where the training thread spends its time, sampled: the ``site_profile`` records.

A straggler is slow in most steps by a little (40 ms more data preparation a batch), never stalled long
enough for a stall sample (``stall_sampler.py``), and its step records say only in which phase the time goes
("between steps"). Which line takes it is the question its user asks next. So at every tick the watchdog
notes the phase the rank is in and the innermost line of user code its training thread is at, and sends
the counts now and then: the collector's straggler analysis names the line a straggler's slow phase was
sampled at most (``server/analysis/profile_sites.py``).

A statistical profile at the watchdog's tick (0.25 s): one frame walk a tick on the watchdog's thread, which
holds the GIL for a few microseconds. Its first record goes out ``FIRST_RECORD_S`` after sampling began, so
a short job has one; then at doubling intervals up to ``MAX_RECORD_EVERY_S``: records are small (at most
``MAX_SITES`` lines each) and a handful an hour.
"""

from __future__ import annotations

from collections import Counter
from types import FrameType
from typing import Any

from ddpscope.agent.torch_waits import DATALOADER_FILE, QUEUE_WAIT_FILES

FIRST_RECORD_S = 5.0
MAX_RECORD_EVERY_S = 60.0
MAX_SITES = 12
"""Lines a record names, the most sampled; the rest are counted in ``other``."""
MIN_SAMPLES = 8
"""Fewer samples in a record's interval (a rank that was hung, or ended): no record."""
_LOADER_FILE = "/" + DATALOADER_FILE
_WAIT_FILES = tuple("/" + name for name in QUEUE_WAIT_FILES)
MAX_WAIT_FRAMES = 12
"""How far out from the innermost frame the DataLoader's frame is looked for, through queue and lock frames."""


def waits_for_loader(frame: FrameType | None) -> bool:
    """Whether the innermost frames are a DataLoader waiting for its workers: a frame of torch's
    dataloader.py with only queue, lock and pipe frames inside it. The line of user code is then the
    loop's ``for batch in loader``, and the time goes in the workers' Dataset reads (with ``num_workers=0``
    the Dataset's own frames are innermost instead, and its line is named)."""
    for _ in range(MAX_WAIT_FRAMES):
        if frame is None:
            return False
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith(_LOADER_FILE):
            return True
        if not (path.endswith(_WAIT_FILES) or path.startswith("<frozen")):
            return False
        frame = frame.f_back
    return False


class SiteProfile:
    """Counts of (phase, site) since the last record; used from the watchdog's thread only."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str | None, bool]] = Counter()
        self._since: float | None = None
        """When the samples counted now began (the watchdog's clock); None before the first."""
        self._every_s = FIRST_RECORD_S

    def add(self, now: float, phase: str, site: str | None, loader: bool = False) -> None:
        """One sample: the rank's phase, the line of user code, whether it waits for its DataLoader's workers."""
        if self._since is None:
            self._since = now
        self._counts[(phase, site, loader)] += 1

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
            "sites": [
                {"phase": phase, "site": site, "n": n, **({"loader": True} if loader else {})}
                for (phase, site, loader), n in top
            ],
            "other": total - sum(n for _, n in top),
        }
