"""Per-step timing state that becomes one ``step`` record (agent/records.py) per rank per iteration.

Independent of any engine: ddpscope's own engine and the adapter for stock torch DDP both drive a
``StepTimer`` with the same verbs, so the two produce identical records::

    timer = StepTimer(rank=0)
    timer.set_buckets([4096, 1024])          # bytes per bucket, after every (re)layout
    timer.forward_start(step=0, synced=True)
    timer.forward_end()
    timer.backward_start()
    timer.bucket_ready(0); timer.allreduce_launched(0, coll_seq=7); timer.allreduce_done(0)
    ...
    record = timer.finish(unused_parameters=[])  # a dict ready for agent.emit()

Every time is ``ddpscope.agent.clock.now_ns()`` (the job's aligned clock) unless the caller passes one
(the CUDA path converts event times itself). A time of 0 means "did not happen in this step" (a bucket
that was never reduced because its step failed, or every bucket of an unsynchronised step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpscope.agent.clock import now_ns


class StepTimer:
    """Collects one iteration's timestamps; hot-path methods are a clock read and a list store."""

    __slots__ = (
        "rank",
        "step",
        "synced",
        "bucket_bytes",
        "_fwd_start",
        "_fwd_end",
        "_bwd_start",
        "_ready",
        "_launch",
        "_done",
        "_seqs",
        "_order",
    )

    def __init__(self, rank: int, bucket_bytes: Sequence[int] = ()) -> None:
        self.rank = rank
        self.step = 0
        self.synced = True
        self.set_buckets(bucket_bytes)
        self._fwd_start = self._fwd_end = self._bwd_start = 0

    def set_buckets(self, bucket_bytes: Sequence[int]) -> None:
        """Call after every (re)layout; takes effect from the next ``forward_start``."""
        self.bucket_bytes = list(bucket_bytes)
        self._reset_buckets()

    def _reset_buckets(self) -> None:
        n = len(self.bucket_bytes)
        self._ready = [0] * n
        self._launch = [0] * n
        self._done = [0] * n
        self._seqs = [0] * n
        self._order: list[int] = []

    def forward_start(self, step: int, synced: bool = True, t_ns: int | None = None) -> None:
        self.step = step
        self.synced = synced
        self._reset_buckets()
        self._fwd_start = now_ns() if t_ns is None else t_ns
        self._fwd_end = self._bwd_start = 0

    def forward_end(self, t_ns: int | None = None) -> None:
        self._fwd_end = now_ns() if t_ns is None else t_ns

    def backward_start(self, t_ns: int | None = None) -> None:
        """First call in a step wins: the engine calls it from whichever hook fires first."""
        if not self._bwd_start:
            self._bwd_start = now_ns() if t_ns is None else t_ns

    def bucket_ready(self, index: int, t_ns: int | None = None) -> None:
        self._ready[index] = now_ns() if t_ns is None else t_ns
        self._order.append(index)

    def allreduce_launched(self, index: int, coll_seq: int, t_ns: int | None = None) -> None:
        self._launch[index] = now_ns() if t_ns is None else t_ns
        self._seqs[index] = coll_seq

    def allreduce_done(self, index: int, t_ns: int | None = None) -> None:
        """Safe from a communication thread: a single list store."""
        self._done[index] = now_ns() if t_ns is None else t_ns

    def set_bucket_times(
        self, ready_ns: Sequence[int], launch_ns: Sequence[int], done_ns: Sequence[int]
    ) -> None:
        """Replace the host-clock bucket times (the CUDA path measures them with device events)."""
        self._ready, self._launch, self._done = list(ready_ns), list(launch_ns), list(done_ns)

    def is_done(self, index: int) -> bool:
        return self._done[index] != 0

    def finish(
        self, unused_parameters: Sequence[str] = (), backward_end_ns: int | None = None
    ) -> dict[str, Any]:
        """The ``step`` record for this iteration (call at the end of backward)."""
        end = now_ns() if backward_end_ns is None else backward_end_ns
        synced = self.synced
        return {
            "kind": "step",
            "rank": self.rank,
            "step": self.step,
            "synced": synced,
            "forward_start_ns": self._fwd_start,
            "forward_end_ns": self._fwd_end,
            # No hook fired (e.g. a backward that reached no parameter): backward is the finalizer alone.
            "backward_start_ns": self._bwd_start or end,
            "backward_end_ns": end,
            "bucket_ready_ns": list(self._ready) if synced else [],
            "allreduce_start_ns": list(self._launch) if synced else [],
            "allreduce_end_ns": list(self._done) if synced else [],
            "bucket_bytes": list(self.bucket_bytes) if synced else [],
            "ready_order": list(self._order) if synced else [],
            "unused_parameters": list(unused_parameters),
            "collective_seqs": list(self._seqs) if synced else [],
        }
