"""A bound on ingest requests in progress: past it, answer 429 instead of queueing without limit.

Under overload a collector that accepts everything piles up requests until memory or the database's
lock timeout gives out; refusing early with ``Retry-After`` lets agents back off (they retry 429) and
keeps the requests already admitted fast.
"""

from __future__ import annotations

import threading

import anyio


class IngestGate:
    """``limit`` requests admitted at once; of those, ``workers`` decode and write at a time.

    Decoding holds the GIL and SQLite's writer is one connection, so two workers already overlap
    the two (one decodes while the other is inside SQLite with the GIL released); more threads only
    fight over the GIL and hold more decoded batches in memory.
    """

    def __init__(self, limit: int, workers: int = 2) -> None:
        self.limit = limit
        self.workers = anyio.CapacityLimiter(workers)
        self._inside = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self._inside >= self.limit:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1

    @property
    def inside(self) -> int:
        return self._inside
